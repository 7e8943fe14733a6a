// The client's side of the conversation, against a scripted stand-in server that records every
// byte the client sends and writes back exactly what the test says: credits, timeouts, a
// server that closes, replies arriving one byte at a time.

import { afterEach, beforeEach, test } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';

import {
  PinpriqClient, PinpriqConnectionError, PinpriqError, PinpriqProtocolError, PinpriqTimeoutError,
  encodeAck, encodeLeasedSubscribe, encodePop, encodePush, encodeReady, encodeReserve,
  encodeSubscribe, encodeSync, encodeTouch,
} from '../index.js';
import { FakeServer, replyBytes, sleep, waitFor } from '../test-support/helpers.js';

/** @type {FakeServer} */
let fake;
beforeEach(async () => { fake = await FakeServer.start(); });
afterEach(async () => { await fake.stop(); });

const connect = (options = {}) => PinpriqClient.connect({ port: fake.port, timeout: 2000, ...options });
const countReady = (bytes) => bytes.filter((byte) => byte === 0x41).length;

test('a subscription opens with its subscribes and prefetch credits, then returns one credit each time the consumer comes back for more', async () => {
  const client = await connect();
  const subscription = await client.subscribe(['a', 'b'], { prefetch: 3 });
  const opening = Buffer.concat([encodeSubscribe('a'), encodeSubscribe('b'), encodeReady(3)]);
  // The subscription has a connection of its own: the client's is connection 0.
  assert.deepEqual(await fake.received(1, opening.length), opening);
  const { socket } = await fake.connection(1);

  socket.write(Buffer.concat([replyBytes(['k1', 'x']), replyBytes(['k2', 'y']), replyBytes(['k3', 'z'])]));
  await waitFor(() => subscription.buffered === 3, 'three deliveries');
  await sleep(50);
  assert.equal(countReady((await fake.connection(1)).received), 3, 'no credit before a delivery is taken');

  for (let taken = 1; taken <= 3; taken += 1) {
    const { value } = await subscription.next();
    assert.equal(value[0].key.toString(), `k${taken}`);
    // Asking for this delivery returned the credit of the one before (none for the first).
    await waitFor(() => countReady(fake.connections[1].received) === 2 + taken, `credit ${2 + taken}`);
    await sleep(20);
    assert.equal(countReady(fake.connections[1].received), 2 + taken, 'no credit for the one in hand');
  }
  const waiting = subscription.next(); // coming back for more returns the third one's credit
  await waitFor(() => countReady(fake.connections[1].received) === 6, 'credit 6');
  assert.equal(fake.connections[0].received.length, 0, 'nothing on the client connection');
  await client.close();
  assert.deepEqual(await waiting, { value: undefined, done: true });
});

test('a delivery arriving one byte per write is handed out whole', async () => {
  const client = await connect();
  const subscription = await client.subscribe('q');
  const { socket } = await fake.connection(1);
  const next = subscription.next();
  for (const byte of replyBytes(['key', 'payload'], ['key', ''])) {
    socket.write(Buffer.from([byte]));
    await sleep(1);
  }
  const { value } = await next;
  assert.deepEqual(value.map(({ key, payload }) => [key.toString(), payload.toString()]),
    [['key', 'payload'], ['key', '']]);
  await client.close();
});

test('pop replies arriving one byte at a time go to their pops in request order', async () => {
  const client = await connect();
  const pops = [client.pop('one'), client.pop('two'), client.pop('three')];
  const { socket } = await fake.connection(0);
  await fake.received(0, 3 * 3 + 3 + 5);
  for (const byte of Buffer.concat([replyBytes(['1', 'a']), replyBytes(), replyBytes(['3', 'c'])])) {
    socket.write(Buffer.from([byte]));
    await sleep(1);
  }
  const [one, two, three] = await Promise.all(pops);
  assert.equal(one[0].key.toString(), '1');
  assert.deepEqual(two, []);
  assert.equal(three[0].key.toString(), '3');
  await client.close();
});

test('an out-of-range argument sends nothing at all', async () => {
  const client = await connect();
  await assert.rejects(client.push('q', 'k', 'p', { prio: 300 }), (error) => {
    assert.ok(error instanceof RangeError);
    assert.ok(!(error instanceof PinpriqError), 'argument errors are not PinpriqErrors');
    return true;
  });
  await assert.rejects(client.push('q', 'k', 'p', { ttlMs: -1 }), RangeError);
  await assert.rejects(client.push('q'.repeat(70000), 'k', 'p'), RangeError);
  const popped = client.pop('q');
  const frame = encodePop('q');
  assert.deepEqual(await fake.received(0, frame.length), frame); // the pop, and only the pop
  (await fake.connection(0)).socket.write(replyBytes());
  assert.deepEqual(await popped, []);
  await client.close();
});

test('a pop that times out leaves the connection in step: its late reply is dropped', async () => {
  const client = await connect({ timeout: 150 });
  await assert.rejects(client.pop('slow'), (error) => {
    assert.ok(error instanceof PinpriqTimeoutError);
    assert.ok(error instanceof PinpriqError, 'a PinpriqError, like every error about the server');
    assert.equal(error.name, 'PinpriqTimeoutError');
    assert.equal(error.code, 'ETIMEDOUT');
    assert.equal(error.address, `127.0.0.1:${fake.port}`);
    assert.match(error.message, new RegExp(`127\\.0\\.0\\.1:${fake.port}`));
    return true;
  });
  const second = client.pop('next');
  const { socket } = await fake.connection(0);
  socket.write(Buffer.concat([replyBytes(['late', '']), replyBytes(['mine', ''])]));
  assert.equal((await second)[0].key.toString(), 'mine');
  await client.close();
});

test('the server closing rejects waiting pops with an error naming the server', async () => {
  const client = await connect();
  const answered = client.pop('first');
  const waiting = client.pop('q');
  const { socket } = await fake.connection(0);
  await fake.received(0, encodePop('first').length + encodePop('q').length);
  socket.write(replyBytes()); // a byte from the server: this is no refused connection
  assert.deepEqual(await answered, []);
  socket.end();
  await assert.rejects(waiting, (error) => {
    assert.ok(error instanceof PinpriqConnectionError);
    assert.ok(error instanceof PinpriqError);
    assert.equal(error.name, 'PinpriqConnectionError');
    assert.equal(error.message, `connection to 127.0.0.1:${fake.port} was closed by the server`);
    return true;
  });
  assert.equal(client.closed, true);
  await assert.rejects(client.push('q', 'k', 'p'), PinpriqConnectionError);
});

/**
 * A server that accepts connections and closes them at once, as a server beyond its
 * connection limit does, except the first `spared` ones. Stop it with `stop()`.
 * @param {(socket: net.Socket) => void} close
 */
async function refusingServer(close, spared = 0) {
  const sockets = [];
  const server = net.createServer((socket) => {
    sockets.push(socket);
    socket.on('error', () => {}); // the client may reset too
    if (sockets.length > spared) close(socket);
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const stop = async () => {
    for (const socket of sockets) socket.destroy();
    await new Promise((resolve) => server.close(resolve));
  };
  return { port: server.address().port, stop };
}

const CLOSED_AT_ONCE = 'the server closed the connection at once (it may be at its connection limit, want a '
  + 'token or TLS, or refuse clients from other hosts)';
const CLOSE_AT_ONCE = [
  ['closes', (socket) => socket.end()],
  ['resets', (socket) => socket.resetAndDestroy()],
];

/**
 * The error of the first step of `use` that fails. A reset can reach the client while it is
 * still connecting, or only once it uses the connection: either way the error must say why.
 * @param {(client: PinpriqClient) => Promise<void>} use
 */
async function firstError(port, use) {
  let client;
  try {
    client = await PinpriqClient.connect({ port, timeout: 2000 });
    await use(client);
  } catch (error) {
    return error;
  } finally {
    client?.destroy();
  }
  return assert.fail('nothing failed');
}

/** Asserts that `error` is the one for a connection the server closed at once. */
function assertClosedAtOnce(error, port) {
  assert.ok(error instanceof PinpriqConnectionError, `${error.name}: ${error.message}`);
  // "cannot connect to" when the reset came during the connect, else "connection to".
  assert.match(error.message, /^(cannot connect to|connection to) /);
  assert.ok(error.message.endsWith(`127.0.0.1:${port}: ${CLOSED_AT_ONCE}`), error.message);
}

for (const [how, close] of CLOSE_AT_ONCE) {
  test(`a server that ${how} a connection at once: calls fail saying so, naming the server`, async () => {
    const server = await refusingServer(close);
    try {
      const error = await firstError(server.port, async (client) => {
        await client.pop('q');
      });
      assertClosedAtOnce(error, server.port);
      // Later calls give the same reason.
      const later = await firstError(server.port, async (client) => {
        await client.pop('q').catch(() => {});
        await client.push('q', 'k', 'v');
      });
      assertClosedAtOnce(later, server.port);
    } finally {
      await server.stop();
    }
  });

  test(`a server that ${how} a subscription's connection at once: it fails saying so`, async () => {
    const server = await refusingServer(close, 1); // the client's own connection is kept
    try {
      const error = await firstError(server.port, async (client) => {
        const subscription = await client.subscribe('q');
        await subscription.next();
      });
      assertClosedAtOnce(error, server.port);
    } finally {
      await server.stop();
    }
  });
}

test('a subscription whose opening cannot be written, the server having closed at once, says so', async () => {
  // 100 subscribes of 6.5 MB in all: more than the sockets take before the server's close
  // makes the write fail.
  const server = await refusingServer((socket) => socket.destroy(), 1);
  try {
    const queues = Array.from({ length: 100 }, (_, i) => String(i).padEnd(65535, 'q'));
    const error = await firstError(server.port, async (client) => {
      const subscription = await client.subscribe(queues);
      await subscription.next();
    });
    assertClosedAtOnce(error, server.port);
  } finally {
    await server.stop();
  }
});

test('a server that closes a connection after a second, having sent nothing, gets the usual message', async () => {
  const client = await connect();
  const waiting = client.pop('q');
  const { socket } = await fake.connection(0);
  await sleep(1100); // past the second within which a close counts as a refusal
  socket.end();
  await assert.rejects(waiting, {
    message: `connection to 127.0.0.1:${fake.port} was closed by the server`,
  });
});

test('a subscription the server closes yields what arrived, then the error, then done', async () => {
  const client = await connect();
  const subscription = await client.subscribe('q', { prefetch: 2 });
  const { socket } = await fake.connection(1);
  socket.end(replyBytes(['k', 'v']));
  await waitFor(() => subscription.closed, 'the subscription to see the close');
  assert.equal((await subscription.next()).value[0].key.toString(), 'k');
  await assert.rejects(subscription.next(), /was closed by the server/);
  assert.deepEqual(await subscription.next(), { value: undefined, done: true });
  await client.close();
});

test('a reply nobody asked for breaks the connection rather than feeding a later pop', async () => {
  const client = await connect();
  (await fake.connection(0)).socket.write(replyBytes(['stray', '']));
  await waitFor(() => client.closed, 'the client to give up the connection');
  await assert.rejects(client.pop('q'), /reply nobody asked for/);
});

test('sync sends 0x21 and takes its 00 00 in its place among the pop replies', async () => {
  const client = await connect();
  const settled = [];
  const calls = [
    client.pop('a').then((reply) => settled.push(['pop a', reply.length])),
    client.sync().then((value) => settled.push(['sync', value])),
    client.pop('b').then((reply) => settled.push(['pop b', reply.length])),
    client.sync().then((value) => settled.push(['sync', value])),
  ];
  const sent = Buffer.concat([encodePop('a'), encodeSync(), encodePop('b'), encodeSync()]);
  assert.deepEqual(await fake.received(0, sent.length), sent);
  const { socket } = await fake.connection(0);
  socket.write(Buffer.concat([replyBytes(['1', 'x']), replyBytes(), replyBytes(), replyBytes()]));
  await Promise.all(calls);
  assert.deepEqual(settled, [['pop a', 1], ['sync', undefined], ['pop b', 0], ['sync', undefined]]);
  await client.close();
});

test('push with confirm sends the push and a sync, and resolves only once the 00 00 arrives', async () => {
  const client = await connect();
  let resolved = false;
  const pushed = client.push('q', 'k', 'v', { prio: 2, confirm: true }).then(() => { resolved = true; });
  const sent = Buffer.concat([encodePush('q', 'k', 'v', { prio: 2 }), encodeSync()]);
  assert.deepEqual(await fake.received(0, sent.length), sent);
  await sleep(50); // room for the promise to resolve too early, if it were going to
  assert.equal(resolved, false, 'not confirmed before the server answered');
  (await fake.connection(0)).socket.write(replyBytes());
  await pushed;
  assert.equal(resolved, true);
  await client.close();
});

test('a push with a delay or a TTL above 65,535 ms goes out as a 71; any other as a 70', async () => {
  const client = await connect();
  await client.push('q', 'k', 'v', { ttlMs: 60_000 });
  await client.push('q', 'k', 'v', { ttlMs: 7_200_000 });
  const confirmed = client.push('q', 'k', 'v', { delayMs: 10_000, prio: 3, confirm: true });
  // Key k (6b), payload v (76), queue q (71) after each header.
  const sent = Buffer.from([
    '70 0001 ea60 01 0001 0001 6b 76 71', // 70: u16 TTL 60,000
    '71 0001 006ddd00 00000000 01 0001 0001 6b 76 71', // 71: u32 TTL 2 h, delay 0
    '71 0001 00000000 00002710 03 0001 0001 6b 76 71', // 71: TTL 0, delay 10 s, prio 3
    '21', // the sync that confirms it
  ].join('').replaceAll(' ', ''), 'hex');
  assert.deepEqual(await fake.received(0, sent.length), sent);
  (await fake.connection(0)).socket.write(replyBytes());
  await confirmed;
  await client.close();
});

// What other servers answer when a pinpriq client talks to them: each reads as a reply whose
// count announces thousands of packets that will never come.
const FOREIGN_ANSWERS = [
  ['Redis', '-ERR unknown command\r\n', '2d 45 ("-E")'],
  ['an HTTP server', 'HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n', '48 54 ("HT")'],
  ['a reply with a packet', replyBytes(['k', 'v']), '00 01'],
];

for (const [server, answer, start] of FOREIGN_ANSWERS) {
  test(`a sync answered as ${server} answers fails at once, says why, and closes the client`, async () => {
    const client = await connect(); // its 2 s timeout would give a PinpriqTimeoutError instead
    const subscription = await client.subscribe('jobs'); // connection 1
    const synced = client.sync();
    const popped = client.pop('q'); // sent after the sync: fails with it
    const { socket } = await fake.connection(0);
    await fake.received(0, 1 + encodePop('q').length);
    socket.write(answer); // and the connection stays open: no end of stream to give up on
    await assert.rejects(synced, (error) => {
      assert.ok(error instanceof PinpriqProtocolError, `${error.name}: ${error.message}`);
      assert.ok(error instanceof PinpriqError);
      assert.equal(error.message, `the server at 127.0.0.1:${fake.port} did not answer like a `
        + `pinpriq 1.1 server: its answer to a sync began ${start}, not 00 00`);
      return true;
    });
    await assert.rejects(popped, PinpriqProtocolError);
    assert.equal(client.closed, true);
    assert.equal(subscription.closed, true, "the client's subscriptions are closed with it");
    await assert.rejects(client.pop('q'), PinpriqProtocolError);
    await client.close();
  });
}

test('a sync the server closes the connection on (as a 1.0 server does) gets the usual error, with a hint', async () => {
  const client = await connect();
  const popped = client.pop('q');
  const { socket } = await fake.connection(0);
  await fake.received(0, encodePop('q').length);
  socket.write(replyBytes()); // a pinpriq server, answering a pop
  assert.deepEqual(await popped, []);
  const synced = client.sync();
  await fake.received(0, encodePop('q').length + 1);
  socket.end();
  await assert.rejects(synced, (error) => {
    assert.ok(error instanceof PinpriqConnectionError, `${error.name}: ${error.message}`);
    assert.equal(error.message, `connection to 127.0.0.1:${fake.port} was closed by the server; `
      + 'it had not answered a sync, and a protocol 1.0 server closes the connection on sync');
    return true;
  });
});

test('a close after a push with options (as a 1.0 or 1.1 server closes on a 71) says so, until a later reply shows it was read', async () => {
  const client = await connect();
  const { socket } = await fake.connection(0);
  const pushed = encodePush('q', 'k', 'v', { delayMs: 1000 });
  const before = client.pop('q'); // sent before the 71: its reply shows nothing about it
  await client.push('q', 'k', 'v', { delayMs: 1000 });
  const after = client.pop('q');
  await fake.received(0, 2 * encodePop('q').length + pushed.length);
  socket.write(replyBytes());
  assert.deepEqual(await before, []);
  socket.end();
  await assert.rejects(after, (error) => {
    assert.equal(error.message, `connection to 127.0.0.1:${fake.port} was closed by the server; `
      + 'it had not shown it read a push with a delay or a TTL above 65,535 ms, and a server '
      + 'older than protocol 1.2 closes the connection on one');
    return true;
  });
});

test('a close after a push with options that a later reply showed was read has no such hint', async () => {
  const client = await connect();
  const { socket } = await fake.connection(0);
  const pushed = encodePush('q', 'k', 'v', { ttlMs: 100_000 });
  await client.push('q', 'k', 'v', { ttlMs: 100_000 });
  const popped = client.pop('q');
  await fake.received(0, pushed.length + encodePop('q').length);
  socket.write(replyBytes());
  assert.deepEqual(await popped, []);
  const again = client.pop('q');
  await fake.received(0, pushed.length + 2 * encodePop('q').length);
  socket.end();
  await assert.rejects(again, { message: `connection to 127.0.0.1:${fake.port} was closed by the server` });
});

test('limit: credits up to the limit and no further, then the iteration ends and the connection closes', async () => {
  const client = await connect();
  const subscription = await client.subscribe('q', { prefetch: 3, limit: 5 });
  const opening = Buffer.concat([encodeSubscribe('q'), encodeReady(3)]);
  assert.deepEqual(await fake.received(1, opening.length), opening);
  const server = await fake.connection(1);
  let serverSawClose = false;
  server.socket.once('close', () => { serverSawClose = true; });

  server.socket.write(Buffer.concat([1, 2, 3].map((i) => replyBytes([`k${i}`, '']))));
  const keys = [];
  for (let i = 0; i < 3; i += 1) keys.push((await subscription.next()).value[0].key.toString());
  // Taking the 2nd and 3rd returned the credits of the 1st and 2nd: 5 in all, the limit.
  await waitFor(() => countReady(server.received) === 5, 'credits 4 and 5');
  server.socket.write(Buffer.concat([4, 5].map((i) => replyBytes([`k${i}`, '']))));
  for (let i = 0; i < 2; i += 1) keys.push((await subscription.next()).value[0].key.toString());
  assert.deepEqual(keys, ['k1', 'k2', 'k3', 'k4', 'k5']);
  assert.equal(subscription.closed, true, 'closed with the last delivery of the limit');
  assert.deepEqual(await subscription.next(), { value: undefined, done: true });
  await waitFor(() => serverSawClose, 'the server to see the subscription close');
  assert.equal(countReady(server.received), 5, 'never a credit beyond the limit');
  await client.close();
});

test('limit below prefetch: the opening grants only `limit` credits', async () => {
  const client = await connect();
  const subscription = await client.subscribe(['a', 'b'], { prefetch: 10, limit: 2 });
  const opening = Buffer.concat([encodeSubscribe('a'), encodeSubscribe('b'), encodeReady(2)]);
  assert.deepEqual(await fake.received(1, opening.length), opening);
  const { socket } = await fake.connection(1);
  socket.write(Buffer.concat([replyBytes(['k1', '']), replyBytes(['k2', ''])]));
  const seen = [];
  for await (const packets of subscription) seen.push(packets[0].key.toString());
  assert.deepEqual(seen, ['k1', 'k2'], 'the loop ends by itself after the limit');
  assert.equal(countReady(fake.connections[1].received), 2);
  await client.close();
});

test('limit and prefetch are checked before anything is sent', async () => {
  const client = await connect();
  for (const limit of [0, -1, 1.5, NaN, Infinity]) {
    await assert.rejects(client.subscribe('q', { limit }), { name: 'RangeError', message: /\blimit\b/ });
  }
  for (const limit of ['3', null]) {
    await assert.rejects(client.subscribe('q', { limit }), { name: 'TypeError', message: /\blimit\b/ });
  }
  await sleep(50); // room for a connection to arrive, if one had been opened
  assert.equal(fake.connections.length, 1, 'only the client connection');
  await client.close();
});


/** A lease message in wire form: lease id u64, attempt (or status) u8, then a reply's body. */
function leaseBytes(leaseId, attempt, ...packets) {
  const header = Buffer.alloc(9);
  header.writeBigUInt64BE(BigInt(leaseId));
  header[8] = attempt;
  return Buffer.concat([header, replyBytes(...packets)]);
}

test('reserve replies and lease answers are read with the 11-byte header, pop replies without', async () => {
  const client = await connect();
  const { socket } = await fake.connection(0);
  const reserved = client.reserve('q', { leaseMs: 500 });
  const popped = client.pop('q');
  const expected = Buffer.concat([encodeReserve('q', { leaseMs: 500 }), encodePop('q')]);
  assert.deepEqual(await fake.received(0, expected.length), expected);
  socket.write(Buffer.concat([leaseBytes(9, 3, ['k', 'v']), replyBytes(['p', ''])]));
  const job = await reserved;
  assert.deepEqual([job.leaseId, job.attempt, job.packets[0].key.toString()], [9, 3, 'k']);
  assert.equal((await popped)[0].key.toString(), 'p');
  const acked = job.ack();
  await fake.received(0, expected.length + 9);
  socket.write(leaseBytes(9, 1)); // status 1, count 0
  assert.equal(await acked, true);
  await client.close();
});

test('an answer about another lease is out of step: the client closes and says so', async () => {
  const client = await connect();
  const { socket } = await fake.connection(0);
  const reserved = client.reserve('q');
  await fake.received(0, 8);
  socket.write(leaseBytes(5, 1, ['k', '']));
  const job = await reserved;
  const acked = job.ack();
  await fake.received(0, 8 + 9);
  socket.write(leaseBytes(6, 1));
  await assert.rejects(acked, /about lease 5 with a message about lease 6/);
  await client.close();
});

test('a leased subscription sorts deliveries from answers, and acks grant no credit', async () => {
  const client = await connect();
  const jobs = await client.subscribe('q', { leaseMs: 100, prefetch: 2 });
  const opening = Buffer.concat([encodeLeasedSubscribe('q', { leaseMs: 100 }), encodeReady(2)]);
  assert.deepEqual(await fake.received(1, opening.length), opening);
  const { socket } = await fake.connection(1);
  socket.write(leaseBytes(1, 1, ['a', '']));
  const first = (await jobs.next()).value;
  const touched = first.touch({ leaseMs: 200 });
  const acked = first.ack();
  const sent = Buffer.concat([opening, encodeTouch(1, { leaseMs: 200 }), encodeAck(1)]);
  assert.deepEqual(await fake.received(1, sent.length), sent);
  // A delivery between the two answers goes to the iterator, not to the ack.
  socket.write(Buffer.concat([leaseBytes(1, 1), leaseBytes(2, 1, ['b', '']), leaseBytes(1, 0)]));
  assert.deepEqual([await touched, await acked], [true, false]);
  await sleep(20);
  assert.equal(countReady(fake.connections[1].received), 2, 'the ack returned no credit');
  const second = (await jobs.next()).value; // asking for it returns the first one's credit
  assert.equal(second.packets[0].key.toString(), 'b');
  await waitFor(() => countReady(fake.connections[1].received) === 3, 'the returned credit');
  await client.close();
});
