// Every method against a real pinpriq-server, started here on an ephemeral port and stopped
// after the tests (pass or fail). Each test uses queues of its own, so order does not matter.

import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { promisify } from 'node:util';

import {
  Lease, LeasedSubscription, PinpriqClient, PinpriqConnectionError, Subscription,
} from '../index.js';
import { startServer } from '../test-support/server.js';
import { closedPort, sleep, waitFor } from '../test-support/helpers.js';

/** @type {import('../test-support/server.js').RunningServer} */
let server;
/** @type {PinpriqClient} */
let client;

before(async () => {
  server = await startServer();
  client = await PinpriqClient.connect({ host: server.host, port: server.port, timeout: 5000 });
});

after(async () => {
  await client?.close();
  await server?.stop();
});

/** A queue name nobody else uses. */
const fresh = (label) => `js-${label}-${randomUUID()}`;

/** Packets with text keys and payloads, for readable assertions. */
const text = (packets) => packets.map(({ key, payload }) => [key.toString(), payload.toString()]);

const connect = (options = {}) => PinpriqClient.connect({
  host: server.host, port: server.port, timeout: 5000, ...options,
});

describe('push and pop', () => {
  test('pop returns Buffers; an emptied or missing queue pops []', async () => {
    const q = fresh('push-pop');
    await client.push(q, 'k1', 'hello', { prio: 3 });
    const [packet, ...rest] = await client.pop(q);
    assert.deepEqual(rest, []);
    assert.ok(Buffer.isBuffer(packet.key) && Buffer.isBuffer(packet.payload));
    assert.deepEqual(text([packet]), [['k1', 'hello']]);
    assert.deepEqual(await client.pop(q), []);
    assert.deepEqual(await client.pop(fresh('never-pushed')), []);
  });

  test('priority order: 1 first, 255 last; prio 0 is never popped on its own', async () => {
    const q = fresh('prio');
    for (const prio of [3, 255, 1, 0, 2]) await client.push(q, `p${prio}`, '', { prio });
    const order = [];
    for (let i = 0; i < 4; i += 1) order.push(...text(await client.pop(q)).map(([key]) => key));
    assert.deepEqual(order, ['p1', 'p2', 'p3', 'p255']);
    assert.deepEqual(await client.pop(q), []); // p0 is still there but cannot be selected
    await client.push(q, 'p0', 'selected', { prio: 9 });
    assert.deepEqual(text(await client.pop(q)), [['p0', 'selected'], ['p0', '']]);
  });

  test('newest wins among equal priorities', async () => {
    const q = fresh('ties');
    for (const key of ['old', 'middle', 'new']) await client.push(q, key, '', { prio: 5 });
    const keys = [];
    for (let i = 0; i < 3; i += 1) keys.push(text(await client.pop(q))[0][0]);
    assert.deepEqual(keys, ['new', 'middle', 'old']);
  });

  test('key grouping: the selected packet, then the rest of its key oldest first, one queue only', async () => {
    const q = fresh('group');
    const other = fresh('group-other');
    await client.push(q, 'K', 'a', { prio: 9 });
    await client.push(q, 'other', 'x', { prio: 1 });
    await client.push(q, 'K', 'b', { prio: 0 });
    await client.push(other, 'K', 'elsewhere', { prio: 1 });
    await client.push(q, 'K', 'c', { prio: 2 });
    await client.push(q, 'K', 'd', { prio: 4 });
    assert.deepEqual(text(await client.pop(q)), [['other', 'x']]);
    assert.deepEqual(text(await client.pop(q)), [['K', 'c'], ['K', 'a'], ['K', 'b'], ['K', 'd']]);
    assert.deepEqual(await client.pop(q), []);
    assert.deepEqual(text(await client.pop(other)), [['K', 'elsewhere']]);
  });

  test('TTL: a packet lives ttlMs milliseconds; 0 never expires', async () => {
    const q = fresh('ttl');
    await client.push(q, 'alive', '', { ttlMs: 5000, prio: 1 });
    assert.deepEqual(text(await client.pop(q)), [['alive', '']]);
    await client.push(q, 'gone', '', { ttlMs: 50, prio: 1 });
    await client.push(q, 'forever', '', { ttlMs: 0, prio: 2 });
    await sleep(200); // well past the 50 ms deadline
    assert.deepEqual(text(await client.pop(q)), [['forever', '']]);
    assert.deepEqual(await client.pop(q), []);
  });

  test('a TTL beyond protocol 1.0 (a 71, protocol 1.2) is taken: the packet is queued', async () => {
    const q = fresh('long-ttl');
    await client.push(q, 'k', 'two hours', { ttlMs: 7_200_000, confirm: true });
    assert.deepEqual(text(await client.pop(q)), [['k', 'two hours']]);
  });

  test('a delayed push (protocol 1.2) is in no queue until it is due, then pops', async () => {
    const q = fresh('delayed');
    await client.push(q, 'later', 'in an hour', { delayMs: 3_600_000 });
    await client.push(q, 'soon', 'in 50 ms', { delayMs: 50 });
    await client.push(q, 'now', '', { confirm: true });
    assert.deepEqual(text(await client.pop(q)), [['now', '']]);
    // However long this takes, 'later' is not due and 'soon' comes once it is.
    let popped = [];
    for (const deadline = Date.now() + 5000; popped.length === 0 && Date.now() < deadline;) {
      await sleep(20);
      popped = await client.pop(q);
    }
    assert.deepEqual(text(popped), [['soon', 'in 50 ms']]);
    assert.deepEqual(await client.pop(q), []);
  });

  test('bytes of any value, empty fields and the largest fields round-trip', async () => {
    const q = Buffer.from([0x00, 0xff, 0x0a, ...Buffer.from(fresh('bytes'))]);
    await client.push(q, new Uint8Array([0, 1, 2]), Buffer.alloc(0));
    assert.deepEqual(await client.pop(q), [{ key: Buffer.from([0, 1, 2]), payload: Buffer.alloc(0) }]);
    assert.deepEqual(await client.pop(q.subarray(0, q.length - 1)), []); // another queue

    const big = fresh('max').padEnd(65535, 'q');
    const key = Buffer.alloc(65535, 'k');
    const payload = Buffer.alloc(65535, 'p');
    await client.push(big, key, payload, { ttlMs: 65535, prio: 255 });
    assert.deepEqual(await client.pop(big), [{ key, payload }]);
  });

  test('UTF-8 text comes back as the same bytes', async () => {
    const q = fresh('utf8-é');
    await client.push(q, 'clé', 'naïve ☃');
    const [packet] = await client.pop(q);
    assert.equal(packet.key.toString('utf8'), 'clé');
    assert.equal(packet.payload.toString('utf8'), 'naïve ☃');
  });
});

describe('pipelining on one client', () => {
  test('concurrent pops resolve in request order, each with its own reply', async () => {
    const queues = Array.from({ length: 50 }, (_, i) => fresh(`pipe${i}`));
    await Promise.all(queues.map((q, i) => client.push(q, 'k', String(i))));
    // Ask in reverse order, all at once.
    const order = [...queues.keys()].reverse();
    const replies = await Promise.all(order.map((i) => client.pop(queues[i])));
    replies.forEach((reply, n) => assert.deepEqual(text(reply), [['k', String(order[n])]]));
  });

  test('pushes and pops not awaited in between keep their order and never interleave', async () => {
    const q = fresh('interleave');
    const big = Buffer.alloc(60_000, 'x');
    const calls = [];
    for (let i = 0; i < 10; i += 1) {
      calls.push(client.push(q, `k${i}`, Buffer.concat([Buffer.from(String(i)), big])));
      calls.push(client.pop(q));
    }
    const results = await Promise.all(calls);
    for (let i = 0; i < 10; i += 1) {
      const [packet] = results[2 * i + 1];
      assert.equal(packet.key.toString(), `k${i}`);
      assert.equal(packet.payload.length, big.length + String(i).length);
    }
  });
});

describe('sync (protocol 1.1)', () => {
  test('a sync resolves in its place among the pops, once the frames before it are applied', async () => {
    const q = fresh('sync');
    const settled = [];
    const after = (label) => () => settled.push(label);
    client.push(q, 'old', '', { prio: 1 });
    client.push(q, 'new', '', { prio: 1 });
    const calls = [
      client.sync().then(after('sync 1')),
      client.pop(q).then((reply) => settled.push(`pop ${text(reply)[0][0]}`)),
      client.sync().then(after('sync 2')),
      client.sync().then(after('sync 3')),
      client.pop(q).then((reply) => settled.push(`pop ${text(reply)[0][0]}`)),
    ];
    await Promise.all(calls);
    assert.deepEqual(settled, ['sync 1', 'pop new', 'sync 2', 'sync 3', 'pop old']);
  });

  test('once sync resolves, another connection sees the pushes made before it', async () => {
    const q = fresh('sync-seen');
    const other = await connect();
    try {
      client.push(q, 'k', 'v');
      await client.sync();
      assert.deepEqual(text(await other.pop(q)), [['k', 'v']]);
    } finally {
      await other.close();
    }
  });

  test('push with confirm resolves once the packet is queued, for every connection to see', async () => {
    const q = fresh('confirm');
    const other = await connect();
    try {
      assert.equal(await client.push(q, 'k', 'stored', { prio: 2, ttlMs: 60000, confirm: true }), undefined);
      assert.deepEqual(text(await other.pop(q)), [['k', 'stored']]);
    } finally {
      await other.close();
    }
  });
});

describe('argument checks on the client', () => {
  test('out-of-range arguments reject with a RangeError naming the field; the client stays usable', async () => {
    const q = fresh('range');
    await assert.rejects(client.push(q, 'k', 'p', { prio: 256 }), { name: 'RangeError', message: /\bprio\b/ });
    await assert.rejects(client.push(q, 'k', 'p', { ttlMs: 2 ** 32 }), { name: 'RangeError', message: /\bttlMs\b/ });
    await assert.rejects(client.push(q, 'k', 'p', { delayMs: 2_592_000_001 }), { name: 'RangeError', message: /\bdelayMs\b/ });
    await assert.rejects(client.push(q, 'k', 'x'.repeat(65536)), { name: 'RangeError', message: /\bpayload\b/ });
    await assert.rejects(client.pop('q'.repeat(65536)), { name: 'RangeError', message: /\bqueue\b/ });
    await assert.rejects(client.subscribe(q, { prefetch: 0 }), { name: 'RangeError', message: /\bprefetch\b/ });
    await assert.rejects(client.subscribe(q, { limit: 0 }), { name: 'RangeError', message: /\blimit\b/ });
    await assert.rejects(client.subscribe([]), { name: 'RangeError', message: /\bqueues\b/ });
    await assert.rejects(client.push(q, 'k', 'p', { confirm: 'yes' }), { name: 'TypeError', message: /\bconfirm\b/ });
    await client.push(q, 'k', 'p');
    assert.deepEqual(text(await client.pop(q)), [['k', 'p']]);
  });

  test('a bad port or timeout is rejected before connecting', async () => {
    await assert.rejects(PinpriqClient.connect({ port: 70000 }), { name: 'RangeError', message: /\bport\b/ });
    await assert.rejects(PinpriqClient.connect({ port: server.port, timeout: -1 }), { name: 'RangeError', message: /\btimeout\b/ });
  });
});

describe('connections', () => {
  test('a refused connection rejects with an error naming host:port', async () => {
    const port = await closedPort();
    await assert.rejects(PinpriqClient.connect({ host: '127.0.0.1', port }), (error) => {
      assert.ok(error instanceof PinpriqConnectionError);
      assert.match(error.message, new RegExp(`127\\.0\\.0\\.1:${port}\\b`));
      assert.equal(error.code, 'ECONNREFUSED');
      assert.equal(error.address, `127.0.0.1:${port}`);
      return true;
    });
  });

  test('close() answers pops already sent, then calls reject naming the server', async () => {
    const own = await connect();
    const q = fresh('close');
    own.push(q, 'k', 'v');
    const popped = own.pop(q);
    await own.close();
    assert.deepEqual(text(await popped), [['k', 'v']]);
    assert.equal(own.closed, true);
    await assert.rejects(own.pop(q), (error) => error instanceof PinpriqConnectionError
      && error.message.includes(`${server.host}:${server.port}`));
  });

  test('a client can be used with await using / Symbol.asyncDispose where available', async () => {
    const own = await connect();
    assert.equal(typeof own.close, 'function');
    if (Symbol.asyncDispose) {
      await own[Symbol.asyncDispose]();
      assert.equal(own.closed, true);
    } else {
      await own.close();
    }
  });
});

describe('a server at its connection limit', () => {
  test('a connection beyond the limit fails saying the server closed it at once', async () => {
    const limited = await startServer({ args: ['--max-connections', '1'] });
    const options = { host: limited.host, port: limited.port, timeout: 5000 };
    let first;
    let second;
    try {
      first = await PinpriqClient.connect(options);
      await first.sync(); // answered: the server counts this connection, the one it allows
      second = await PinpriqClient.connect(options);
      await assert.rejects(second.pop(fresh('limit')), (error) => {
        assert.ok(error instanceof PinpriqConnectionError, `${error.name}: ${error.message}`);
        assert.equal(error.message, `connection to ${limited.host}:${limited.port}: the server `
          + 'closed the connection at once (it may be at its connection limit, want a token or TLS, '
          + 'or refuse clients from other hosts)');
        return true;
      });
    } finally {
      second?.destroy();
      await first?.close();
      await limited.stop();
    }
  });
});

describe('subscriptions', () => {
  test('deliveries come in the pop-reply form, to an iterator on its own connection', async () => {
    const q = fresh('sub');
    await client.push(q, 'K', 'a', { prio: 3 });
    await client.push(q, 'K', 'b', { prio: 0 });
    await client.push(q, 'K', 'c', { prio: 1 });
    await client.pop(fresh('barrier')); // its reply proves the pushes were applied
    const subscription = await client.subscribe(q);
    assert.ok(subscription instanceof Subscription);
    const seen = [];
    for await (const packets of subscription) {
      seen.push(text(packets));
      if (seen.length === 1) await client.push(q, 'next', 'one'); // delivered as it arrives
      if (seen.length === 2) break; // leaving the loop closes the subscription's connection
    }
    assert.equal(subscription.closed, true);
    assert.deepEqual(seen, [
      [['K', 'c'], ['K', 'a'], ['K', 'b']], // one delivery is a whole key group
      [['next', 'one']],
    ]);
    assert.deepEqual(await client.pop(q), []);
  });

  test('the best packet across several queues comes first', async () => {
    const a = fresh('best-a');
    const b = fresh('best-b');
    await client.push(a, 'a2', '', { prio: 2 });
    await client.push(b, 'b1', '', { prio: 1 });
    await client.push(a, 'a3', '', { prio: 3 });
    await client.pop(fresh('barrier'));
    const subscription = await client.subscribe([a, b], { prefetch: 3 });
    const keys = [];
    for await (const packets of subscription) {
      keys.push(text(packets)[0][0]);
      if (keys.length === 3) break;
    }
    assert.deepEqual(keys, ['b1', 'a2', 'a3']);
  });

  test('prefetch 3 never holds more than 3 undelivered; the rest stays queued', async () => {
    const q = fresh('prefetch');
    const popper = await connect(); // a second connection, to look at what is still queued
    const subscription = await client.subscribe(q, { prefetch: 3 });
    try {
      for (let i = 0; i < 10; i += 1) await client.push(q, `k${i}`, '', { prio: 1 });
      await waitFor(() => subscription.buffered === 3, '3 deliveries');
      await sleep(100); // room for a 4th delivery, if the client had granted too many credits
      assert.equal(subscription.buffered, 3);

      // Taking one grants nothing yet: the delivery in hand counts against prefetch.
      const first = await subscription.next();
      assert.equal(first.done, false);
      await sleep(100);
      assert.equal(subscription.buffered, 2);
      // Coming back for the next returns the first one's credit: exactly one more arrives.
      const second = await subscription.next();
      assert.equal(second.done, false);
      await waitFor(() => subscription.buffered === 2, 'the delivery replacing the first');
      await sleep(100);
      assert.equal(subscription.buffered, 2);

      // 10 pushed, 4 delivered: the other 6 are still in the queue, for anyone.
      const left = [];
      for (;;) {
        const reply = await popper.pop(q);
        if (reply.length === 0) break;
        left.push(...text(reply).map(([key]) => key));
      }
      assert.equal(left.length, 6);
      const delivered = [first.value, second.value];
      for (let i = 0; i < 2; i += 1) delivered.push((await subscription.next()).value);
      const all = [...left, ...delivered.flatMap((d) => text(d).map(([key]) => key))].sort();
      assert.deepEqual(all, Array.from({ length: 10 }, (_, i) => `k${i}`).sort());
    } finally {
      await subscription.close();
      await popper.close();
    }
  });

  test('limit: the loop ends after that many deliveries, and the rest stays queued', async () => {
    const q = fresh('limit');
    for (let i = 0; i < 5; i += 1) client.push(q, `k${i}`, '', { prio: 1 });
    await client.sync();
    const subscription = await client.subscribe([q], { prefetch: 2, limit: 3 });
    const keys = [];
    for await (const packets of subscription) keys.push(text(packets)[0][0]);
    assert.deepEqual(keys, ['k4', 'k3', 'k2'], 'newest first, three of them');
    assert.equal(subscription.closed, true);
    // No credit beyond the limit was granted, so nothing more was taken from the queue.
    assert.deepEqual(text(await client.pop(q)), [['k1', '']]);
    assert.deepEqual(text(await client.pop(q)), [['k0', '']]);
  });

  test('close() ends a waiting iteration; closing the client closes its subscriptions', async () => {
    const own = await connect();
    const subscription = await own.subscribe(fresh('idle'));
    const waiting = subscription.next();
    await subscription.close();
    assert.deepEqual(await waiting, { value: undefined, done: true });
    assert.deepEqual(await subscription.next(), { value: undefined, done: true });

    const other = await own.subscribe(fresh('idle2'));
    await own.close();
    assert.equal(other.closed, true);
    await assert.rejects(own.subscribe(fresh('late')), PinpriqConnectionError);
  });
});

describe('leases (protocol 1.1)', () => {
  test('reserve leases the group; ack is for good and answers once; an empty reserve is empty', async () => {
    const q = fresh('reserve');
    await client.push(q, 'K', 'a', { prio: 2 });
    await client.push(q, 'K', 'b', { prio: 0 });
    const job = await client.reserve(q, { leaseMs: 60_000 });
    assert.ok(job instanceof Lease);
    assert.equal(job.attempt, 1);
    assert.deepEqual(text(job.packets), [['K', 'a'], ['K', 'b']]);
    assert.deepEqual(await client.pop(q), []); // leased: out of its queue
    assert.equal(await job.touch({ leaseMs: 60_000 }), true);
    assert.equal(await job.ack(), true);
    assert.equal(await job.ack(), false); // over: the server answers status 0
    const none = await client.reserve(q);
    assert.equal(none.empty, true);
    assert.equal(none.leaseId, 0);
    assert.equal(await none.ack(), false);
  });

  test('a lease and a plain subscription of one client never share a connection', async () => {
    // Decision 20: the server closes a connection that mixes them; the subscription has a
    // connection of its own, so the client's lease frames go on working beside it.
    const q = fresh('mixing');
    const events = fresh('mixing-events');
    await client.push(q, 'k', 'v');
    const job = await client.reserve(q);
    const subscription = await client.subscribe(events);
    await client.push(events, 'e', '1');
    const { value } = await subscription.next();
    assert.deepEqual(text(value), [['e', '1']]);
    assert.equal(await job.ack(), true);
    await subscription.close();
  });

  test('a released job comes back in its place, on its next attempt, after its delay', async () => {
    const q = fresh('release');
    await client.push(q, 'old', '', { prio: 2 });
    const job = await client.reserve(q);
    await client.push(q, 'new', '', { prio: 2 });
    assert.equal(await job.release({ delayMs: 150 }), true);
    assert.equal(await job.touch(), false); // the lease ended with the release
    assert.deepEqual(text(await client.pop(q)), [['new', '']]);
    assert.equal((await client.reserve(q)).empty, true); // not back yet
    await sleep(300);
    const again = await client.reserve(q);
    assert.deepEqual([again.attempt, text(again.packets)], [2, [['old', '']]]);
    assert.equal(await again.ack(), true);
  });

  test('a lease left to lapse comes back, and its ack says so', async () => {
    const q = fresh('lapse');
    await client.push(q, 'k', 'v');
    const job = await client.reserve(q, { leaseMs: 100 });
    await sleep(250);
    assert.equal(await job.ack(), false);
    assert.deepEqual(text(await client.pop(q)), [['k', 'v']]);
  });

  test('a leased subscription delivers Leases; those not acked go back when it closes', async () => {
    const q = fresh('leased-sub');
    for (const key of ['a', 'b', 'c']) await client.push(q, key, '');
    const jobs = await client.subscribe(q, { leaseMs: 60_000, prefetch: 2 });
    assert.ok(jobs instanceof LeasedSubscription);
    const first = (await jobs.next()).value;
    assert.deepEqual([first.leaseId, text(first.packets)], [1, [['c', '']]]);
    assert.equal(await first.ack(), true);
    const second = (await jobs.next()).value;
    assert.equal(await second.touch(), true);
    await jobs.close(); // "b" in hand and "a" delivered ahead: neither acked
    const back = [];
    for (let i = 0; i < 100 && back.length < 2; i += 1) { // the server sees the close soon
      back.push(...text(await client.pop(q)));
      if (back.length < 2) await sleep(10);
    }
    assert.deepEqual(back.map(([key]) => key).sort(), ['a', 'b']);
  });

  test('work keeps a slow job alive, releases a failed one, and acks after a sync', async () => {
    const q = fresh('work');
    const done = fresh('work-done');
    await client.push(q, 'job', 'x');
    const attempts = [];
    const errors = [];
    await client.work(q, async (job) => {
      attempts.push(job.attempt);
      if (attempts.length === 1) throw new Error('flaky');
      await sleep(500); // five times the lease: touches keep it
      await client.push(done, 'follow-up', '');
    }, { leaseMs: 100, limit: 2, onError: (error) => errors.push(error.message) });
    assert.deepEqual(attempts, [1, 2]);
    assert.deepEqual(errors, ['flaky']);
    assert.deepEqual(text(await client.pop(done)), [['follow-up', '']]);
    assert.deepEqual(await client.pop(q), []); // acked, not lapsed and back
  });

  test('lease arguments out of range are refused before anything is sent', async () => {
    await assert.rejects(client.reserve('q', { leaseMs: 86_400_001 }), RangeError);
    await assert.rejects(client.subscribe('q', { leaseMs: -1 }), RangeError);
    await assert.rejects(client.work('q', async () => {}, { leaseMs: 0 }), RangeError);
  });
});

/** A README example, made to import this package and talk to this test's server. */
function runnable(example) {
  return example
    .replace("from 'pinpriq'", `from ${JSON.stringify(new URL('../index.js', import.meta.url).href)}`)
    .replace('port: 7000', `port: ${server.port}`);
}

test("the README's delayed job example runs as written: the job is not there yet", async () => {
  const readme = readFileSync(new URL('../README.md', import.meta.url), 'utf8');
  const example = /A job to run in ten minutes[\s\S]*?```js\n([\s\S]*?)```/.exec(readme)[1];
  const { stdout } = await promisify(execFile)(
    process.execPath, ['--input-type=module', '-e', runnable(example)], { timeout: 10_000 },
  );
  assert.equal(stdout, '[]\n');
});

test("the README's example runs as written (against this test's server)", async () => {
  const readme = readFileSync(new URL('../README.md', import.meta.url), 'utf8');
  const example = /## Example[\s\S]*?```js\n([\s\S]*?)```/.exec(readme)[1];
  assert.equal(example.trim().split('\n').length, 5, 'the example is five lines');
  const { stdout } = await promisify(execFile)(
    process.execPath, ['--input-type=module', '-e', runnable(example)], { timeout: 10_000 },
  );
  assert.equal(stdout, 'job-1: resize cat.jpg\n');
});
