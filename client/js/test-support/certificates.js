// A throwaway certificate authority and a server certificate for 127.0.0.1, for the TLS tests,
// made by the `openssl` command (any OpenSSL 1.1.1 or newer): Node has no API to issue
// certificates, and the tests must need nothing from Python's test environment. A missing
// `openssl` must fail, not skip.

import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';

// Python's ssl (the server) checks X.509 strictly: the CA's basic constraints are critical and
// the leaf names the key that signed it.
const CA_EXTENSIONS = [
  'basicConstraints=critical,CA:TRUE',
  'keyUsage=critical,keyCertSign,cRLSign',
  'subjectKeyIdentifier=hash',
];
const SERVER_EXTENSIONS = `\
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
`;
const KEY = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes'];

function openssl(args) {
  try {
    execFileSync('openssl', args, { stdio: ['ignore', 'ignore', 'pipe'] });
  } catch (error) {
    const reason = error.code === 'ENOENT' ? 'the openssl command is not installed' : error.stderr;
    throw new Error(`cannot make the TLS tests' certificates: ${reason}`);
  }
}

/**
 * Makes a CA and a server certificate for 127.0.0.1 and localhost in a new directory.
 * @returns {{ dir: string, ca: Buffer, cert: string, key: string }}
 */
export function makeCertificates() {
  const dir = mkdtempSync(path.join(tmpdir(), 'pinpriq-tls-'));
  const file = (name) => path.join(dir, name);
  openssl(['req', '-x509', ...KEY, '-keyout', file('ca.key'), '-out', file('ca.pem'),
    '-subj', '/CN=pinpriq test CA', '-days', '2', ...CA_EXTENSIONS.flatMap((e) => ['-addext', e])]);
  openssl(['req', '-new', ...KEY, '-keyout', file('server.key'), '-out', file('server.csr'),
    '-subj', '/CN=127.0.0.1']);
  writeFileSync(file('server.ext'), SERVER_EXTENSIONS);
  openssl(['x509', '-req', '-in', file('server.csr'), '-CA', file('ca.pem'), '-CAkey', file('ca.key'),
    '-set_serial', '1', '-days', '2', '-extfile', file('server.ext'), '-out', file('server.pem')]);
  return { dir, ca: readFileSync(file('ca.pem')), cert: file('server.pem'), key: file('server.key') };
}
