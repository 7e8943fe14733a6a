// The server the live tests use, checked first. Importing test-support/server.js checks that
// pinpriq-server can be found; if it cannot, it prints one line saying so and fails this file.
// node --test runs and reports test files in the order of their names (as a shell sorts the
// CI's glob), and a digit sorts before any letter, so that line is the first thing a run
// prints, rather than one spawn error among the live tests' many failures.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';

import { startServer } from '../test-support/server.js';

test('the test server is a pinpriq 1.1 server: it answers a sync with 00 00', async () => {
  const server = await startServer();
  try {
    const socket = net.connect({ host: server.host, port: server.port });
    // A sync, then the end of our stream: the server answers what it read, then closes.
    socket.end(Buffer.from([0x21]));
    const chunks = [];
    for await (const chunk of socket) chunks.push(chunk);
    assert.deepEqual(Buffer.concat(chunks), Buffer.from([0x00, 0x00]));
  } finally {
    await server.stop();
  }
});
