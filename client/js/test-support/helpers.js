// Small bounded waits and a scripted stand-in server, for tests that need to see or control
// the bytes on the wire.

import net from 'node:net';
import { setTimeout as sleep } from 'node:timers/promises';

export { sleep };

/**
 * Polls `predicate` until it is true; fails after `timeoutMs`.
 * @param {() => boolean} predicate
 * @param {string} what for the failure message
 */
export async function waitFor(predicate, what, timeoutMs = 3000) {
  const deadline = Date.now() + timeoutMs;
  while (!predicate()) {
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(5);
  }
}

/**
 * A TCP server on 127.0.0.1 that records what each connection sends and lets the test write
 * whatever it likes back.
 */
export class FakeServer {
  /** @type {{ socket: net.Socket, received: Buffer }[]} */
  connections = [];

  /** @returns {Promise<FakeServer>} listening on an ephemeral port */
  static async start() {
    const fake = new FakeServer();
    fake.server = net.createServer((socket) => {
      const connection = { socket, received: Buffer.alloc(0) };
      socket.on('data', (chunk) => { connection.received = Buffer.concat([connection.received, chunk]); });
      socket.on('error', () => {}); // the client may reset; the test checks what it needs
      fake.connections.push(connection);
    });
    await new Promise((resolve) => fake.server.listen(0, '127.0.0.1', resolve));
    fake.port = fake.server.address().port;
    return fake;
  }

  /** Waits for the n-th connection (0-based). */
  async connection(n = 0) {
    await waitFor(() => this.connections.length > n, `connection ${n}`);
    return this.connections[n];
  }

  /** Waits until connection n has received at least `count` bytes, and returns them all. */
  async received(n, count) {
    const connection = await this.connection(n);
    await waitFor(() => connection.received.length >= count, `${count} bytes on connection ${n}`);
    return connection.received;
  }

  async stop() {
    for (const { socket } of this.connections) socket.destroy();
    await new Promise((resolve) => this.server.close(resolve));
  }
}

/** A reply in wire form: count, then each packet's lengths, key and payload. */
export function replyBytes(...packets) {
  const parts = [Buffer.from([packets.length >> 8, packets.length & 0xff])];
  for (const [key, payload] of packets) {
    const header = Buffer.alloc(4);
    header.writeUInt16BE(Buffer.byteLength(key), 0);
    header.writeUInt16BE(Buffer.byteLength(payload), 2);
    parts.push(header, Buffer.from(key), Buffer.from(payload));
  }
  return Buffer.concat(parts);
}

/** A closed TCP port on 127.0.0.1: bound once to find a free one, then released. */
export async function closedPort() {
  const server = net.createServer();
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  return port;
}
