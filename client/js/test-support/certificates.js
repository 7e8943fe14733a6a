// A throwaway certificate authority and a server certificate for 127.0.0.1, for the TLS tests,
// made by the trustme package of the Python test environment (the one whose pinpriq-server the
// tests run): Node has no API to issue certificates, and a missing tool must fail, not skip.

import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';

const SCRIPT = `
import sys, trustme
directory = sys.argv[1]
for name, ca in (("", trustme.CA()), ("other-", trustme.CA())):
    ca.cert_pem.write_to_path(f"{directory}/{name}ca.pem")
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    leaf.private_key_and_cert_chain_pem.write_to_path(f"{directory}/{name}server.pem")
    leaf.private_key_pem.write_to_path(f"{directory}/{name}server.key")
`;

/**
 * Makes a CA and a server certificate (and a second, unrelated pair) in a new directory.
 * @returns {{ dir: string, ca: Buffer, cert: string, key: string }}
 */
export function makeCertificates() {
  const dir = mkdtempSync(path.join(tmpdir(), 'pinpriq-tls-'));
  const python = process.env.PINPRIQ_PYTHON || 'python3';
  execFileSync(python, ['-c', SCRIPT, dir], { stdio: ['ignore', 'ignore', 'inherit'] });
  return {
    dir,
    ca: readFileSync(path.join(dir, 'ca.pem')),
    cert: path.join(dir, 'server.pem'),
    key: path.join(dir, 'server.key'),
  };
}
