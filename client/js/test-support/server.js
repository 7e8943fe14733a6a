// Starts a real pinpriq server for the tests: `pinpriq-server --port 0` on 127.0.0.1, whose
// port is read from its log line "pinpriq listening on 127.0.0.1 port N" on stderr.
//
// The command is $PINPRIQ_SERVER if set, else `pinpriq-server` from PATH (in CI, the venv the
// Python step made). There is deliberately no silent fallback: a missing server is an error.

import { spawn } from 'node:child_process';

const LISTENING = /pinpriq listening on (\S+) port (\d+)/;
const START_TIMEOUT_MS = 10_000;
const STOP_TIMEOUT_MS = 3_000;

/**
 * @typedef {{ host: string, port: number, stop: () => Promise<void>, log: () => string }}
 *   RunningServer
 */

/**
 * Start a server on an ephemeral port and wait until it listens.
 * @param {{ args?: string[] }} [options] `args`: more command-line options for the server
 * @returns {Promise<RunningServer>}
 */
export async function startServer({ args = [] } = {}) {
  const command = process.env.PINPRIQ_SERVER || 'pinpriq-server';
  const child = spawn(command, ['--host', '127.0.0.1', '--port', '0', ...args], {
    stdio: ['ignore', 'ignore', 'pipe'],
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
        ? new Error(`cannot run ${command}: not found on PATH. Install the Python package `
          + '(python3 -m venv .venv && .venv/bin/pip install -e .) and put its bin/ on PATH, '
          + 'or set PINPRIQ_SERVER to the pinpriq-server executable')
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
