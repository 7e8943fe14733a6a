// Starts a real pinpriq server for the tests: `pinpriq-server --port 0` on 127.0.0.1, whose
// port is read from its log line "pinpriq listening on 127.0.0.1 port N" on stderr.
//
// The command is $PINPRIQ_SERVER if set, else `pinpriq-server` from PATH (in CI, the venv the
// Python step made). There is deliberately no silent fallback: a missing server is an error,
// and importing this module checks for it (see below).

import { spawn } from 'node:child_process';
import { accessSync, constants, statSync } from 'node:fs';
import path from 'node:path';

/** What the tests run as the server. */
const COMMAND = process.env.PINPRIQ_SERVER || 'pinpriq-server';
const LISTENING = /pinpriq listening on (\S+) port (\d+)/;
const START_TIMEOUT_MS = 10_000;
const STOP_TIMEOUT_MS = 3_000;

/** Why there is no server to run, in one line. */
const NOT_FOUND = process.env.PINPRIQ_SERVER
  ? `PINPRIQ_SERVER=${COMMAND} is neither an executable file nor a command on PATH: point it `
    + 'at pinpriq-server, or unset it to use pinpriq-server from PATH'
  : 'pinpriq-server not found on PATH: install the Python package (pip install . in the '
    + 'repository root) and put its bin directory on PATH, or set PINPRIQ_SERVER to the '
    + 'executable';

/** @param {string} file @returns {boolean} */
function isExecutableFile(file) {
  try {
    accessSync(file, constants.X_OK);
    return statSync(file).isFile();
  } catch {
    return false;
  }
}

/**
 * Whether `command` can be run: a path to an executable file, or a name found on PATH, as
 * spawn would find it.
 * @param {string} command
 * @returns {boolean}
 */
function canRun(command) {
  if (command.includes('/') || command.includes(path.sep)) return isExecutableFile(command);
  const extensions = process.platform === 'win32'
    ? ['', ...(process.env.PATHEXT ?? '.EXE;.CMD;.BAT').split(';')]
    : [''];
  return (process.env.PATH ?? '').split(path.delimiter).some((dir) => extensions
    .some((extension) => isExecutableFile(path.join(dir || '.', command + extension))));
}

// Checked on import, before any test runs: without a server, every live test would fail with
// the same spawn error and the reason would be lost among their failures. Instead one line
// on stderr, and this test file fails. test/0-test-server.test.js imports this module and
// sorts first, so that node --test prints the line before anything else.
if (!canRun(COMMAND)) {
  process.stderr.write(`${NOT_FOUND}\n`);
  process.exit(1);
}

/**
 * @typedef {{ host: string, port: number, stop: () => Promise<void>, log: () => string }}
 *   RunningServer
 */

/**
 * Start a server on an ephemeral port and wait until it listens.
 * @param {{ args?: string[], env?: Record<string, string> }} [options] `args`: more
 *   command-line options for the server; `env`: more environment variables (a token)
 * @returns {Promise<RunningServer>}
 */
export async function startServer({ args = [], env = {} } = {}) {
  const command = COMMAND;
  // --http-port 0: an admin listener on a free port, never the default 7001, so servers
  // started side by side do not collide.
  const child = spawn(command, ['--host', '127.0.0.1', '--port', '0', '--http-port', '0', ...args], {
    stdio: ['ignore', 'ignore', 'pipe'],
    env: { ...process.env, ...env },
  });
  // If the test process dies before its after() hook runs, don't leave the server behind.
  const killOnExit = () => child.kill('SIGKILL');
  process.once('exit', killOnExit);
  let stderr = '';
  child.stderr.setEncoding('utf8');
  child.stderr.on('data', (text) => { stderr += text; });

  const exited = new Promise((resolve) => child.once('exit', (code, signal) => resolve({ code, signal })));
  const stop = async () => {
    process.removeListener('exit', killOnExit);
    if (child.pid === undefined) return; // never started
    if (child.exitCode !== null || child.signalCode !== null) return;
    child.kill('SIGTERM');
    const timer = setTimeout(() => child.kill('SIGKILL'), STOP_TIMEOUT_MS);
    await exited;
    clearTimeout(timer);
  };

  try {
    const port = await new Promise((resolve, reject) => {
      const timer = setTimeout(
        () => reject(new Error(`${command} did not log its port within ${START_TIMEOUT_MS} ms`)),
        START_TIMEOUT_MS,
      );
      const settle = (fn, value) => { clearTimeout(timer); fn(value); };
      child.once('error', (error) => settle(reject, error.code === 'ENOENT'
        ? new Error(NOT_FOUND) // gone since the check on import
        : error));
      child.stderr.on('data', () => {
        const match = LISTENING.exec(stderr);
        if (match) settle(resolve, Number(match[2]));
      });
      exited.then(({ code, signal }) => settle(reject, new Error(
        `${command} exited (${signal ?? code}) before listening:\n${stderr}`,
      )));
    });
    return { host: '127.0.0.1', port, stop, log: () => stderr };
  } catch (error) {
    await stop();
    throw error;
  }
}
