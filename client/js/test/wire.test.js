// The sans-I/O codec on its own: argument checks, text and byte inputs, and the reply decoder.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';

import {
  MAX_FIELD_BYTES, ReplyDecoder, encodeAck, encodeLeasedSubscribe, encodePop, encodePush,
  encodeReady, encodeRelease, encodeReserve, encodeSubscribe, encodeSync, encodeTouch,
  encodeUnsubscribe,
} from '../src/wire.js';
import * as pinpriq from '../index.js';

/** Asserts that fn throws a RangeError whose message names `field`. */
function assertRangeError(fn, field) {
  assert.throws(fn, (error) => {
    assert.ok(error instanceof RangeError, `${error?.name}: ${error?.message}`);
    assert.match(error.message, new RegExp(`\\b${field}\\b`));
    return true;
  });
}

describe('encoder argument checks', () => {
  const big = 'x'.repeat(MAX_FIELD_BYTES + 1);

  test('ttlMs outside 0..4294967295 or not an integer', () => {
    for (const ttlMs of [-1, 2 ** 32, 1.5, NaN, Infinity]) {
      assertRangeError(() => encodePush('q', 'k', 'p', { ttlMs }), 'ttlMs');
    }
  });

  test('delayMs outside 0..2592000000 (30 days) or not an integer', () => {
    for (const delayMs of [-1, 2_592_000_001, 0.5, NaN]) {
      assertRangeError(() => encodePush('q', 'k', 'p', { delayMs }), 'delayMs');
    }
    assert.throws(() => encodePush('q', 'k', 'p', { delayMs: '10' }), { name: 'TypeError', message: /\bdelayMs\b/ });
  });

  test('prio outside 0..255 or not an integer', () => {
    for (const prio of [-1, 256, 0.5]) {
      assertRangeError(() => encodePush('q', 'k', 'p', { prio }), 'prio');
    }
  });

  test('queue, key or payload over 65,535 bytes', () => {
    assertRangeError(() => encodePush(big, 'k', 'p'), 'queue');
    assertRangeError(() => encodePush('q', big, 'p'), 'key');
    assertRangeError(() => encodePush('q', 'k', Buffer.alloc(MAX_FIELD_BYTES + 1)), 'payload');
    assertRangeError(() => encodePop(big), 'queue');
    assertRangeError(() => encodeSubscribe(big), 'queue');
    assertRangeError(() => encodeUnsubscribe(big), 'queue');
  });

  test('the limit counts UTF-8 bytes, not characters', () => {
    const twoByteChars = 'é'.repeat(32768); // 32,768 characters, 65,536 bytes
    assertRangeError(() => encodePop(twoByteChars), 'queue');
    assert.equal(encodePop('é'.repeat(32767)).length, 3 + 65534);
  });

  test('the largest values are accepted', () => {
    const max = 'm'.repeat(MAX_FIELD_BYTES);
    const frame = encodePush(max, max, max, { ttlMs: 65535, prio: 255 });
    assert.equal(frame.length, 196_615); // protocol 1.0's largest frame
    assert.equal(encodePush('', '', '', { ttlMs: 0, prio: 0 }).length, 10); // and its smallest
    const options = { ttlMs: 2 ** 32 - 1, delayMs: 2_592_000_000, prio: 255 };
    assert.equal(encodePush(max, max, max, options).length, 196_621); // 1.2's largest
  });

  test('a field that is neither text nor bytes is a TypeError naming it', () => {
    assert.throws(() => encodePush('q', 42, 'p'), { name: 'TypeError', message: /\bkey\b/ });
    assert.throws(() => encodePop(null), { name: 'TypeError', message: /\bqueue\b/ });
    assert.throws(() => encodePush('q', 'k', 'p', { prio: '3' }), { name: 'TypeError', message: /\bprio\b/ });
  });
});

describe('encoder inputs', () => {
  test('strings are UTF-8; Buffers and Uint8Arrays are taken as they are', () => {
    const text = encodePush('qé', 'k', 'ü');
    const bytes = encodePush(
      Buffer.from('qé'), new Uint8Array([0x6b]), new Uint8Array(Buffer.from('ü')),
    );
    assert.deepEqual(text, bytes);
    // A Uint8Array that is a window on a larger buffer: only its own bytes count.
    const window = new Uint8Array([1, 2, 0x6b, 3]).subarray(2, 3);
    assert.deepEqual(encodePop(window), encodePop('k'));
  });

  test('defaults: TTL 0 (never expires) and prio 1 (highest)', () => {
    assert.deepEqual(encodePush('q', 'k', 'p'), encodePush('q', 'k', 'p', { ttlMs: 0, prio: 1 }));
  });

  test('ready: one 0x41 byte per credit', () => {
    assert.deepEqual(encodeReady(), Buffer.from([0x41]));
    assert.deepEqual(encodeReady(3), Buffer.from([0x41, 0x41, 0x41]));
  });

  test('sync (protocol 1.1): the single byte 0x21, a Buffer of its own each time', () => {
    assert.deepEqual(encodeSync(), Buffer.from([0x21]));
    encodeSync()[0] = 0; // a caller scribbling on one frame must not change the next
    assert.deepEqual(encodeSync(), Buffer.from([0x21]));
    assert.equal(pinpriq.encodeSync, encodeSync, 'pinpriq re-exports it, as it does the others');
  });
});

describe('push with options (protocol 1.2)', () => {
  const hex = (buffer) => buffer.toString('hex');

  test('a push is a 70 while protocol 1.0 can say it: no delay, a TTL up to 65,535 ms', () => {
    // 70 | queue_len u16 | ttl u16 | prio u8 | key_len u16 | payload_len u16 | k | p | q
    assert.equal(hex(encodePush('q', 'k', 'p', { ttlMs: 65_535, prio: 2 })), '700001ffff02000100016b7071');
    assert.equal(encodePush('q', 'k', 'p', { delayMs: 0 })[0], 0x70);
  });

  test('a longer TTL or a delay makes it a 71: u32 TTL, then u32 delay', () => {
    // 71 | queue_len u16 | ttl u32 | delay u32 | prio u8 | key_len u16 | payload_len u16 | ...
    assert.equal(hex(encodePush('q', 'k', 'p', { ttlMs: 65_536 })),
      '710001' + '00010000' + '00000000' + '01' + '00010001' + '6b7071');
    assert.equal(hex(encodePush('jobs', 'k', 'p', { ttlMs: 7_200_000, delayMs: 10_000, prio: 3 })),
      '710004' + '006ddd00' + '00002710' + '03' + '00010001' + '6b70' + hex(Buffer.from('jobs')));
    assert.equal(hex(encodePush('', '', '', { delayMs: 2_592_000_000 })),
      '710000' + '00000000' + '9a7ec800' + '01' + '00000000');
  });

  test('the limits are exported', () => {
    assert.equal(pinpriq.MAX_TTL_MS, 4_294_967_295);
    assert.equal(pinpriq.MAX_TTL_MS_1_0, 65_535);
    assert.equal(pinpriq.MAX_DELAY_MS, 2_592_000_000);
    assert.equal(pinpriq.OPCODE.PUSH_OPTIONS, 0x71);
  });
});

describe('reply decoder', () => {
  const reply = (...packets) => {
    const parts = [Buffer.from([packets.length >> 8, packets.length & 0xff])];
    for (const [key, payload] of packets) {
      const header = Buffer.alloc(4);
      header.writeUInt16BE(key.length, 0);
      header.writeUInt16BE(payload.length, 2);
      parts.push(header, Buffer.from(key), Buffer.from(payload));
    }
    return Buffer.concat(parts);
  };
  const packet = (key, payload) => ({ key: Buffer.from(key), payload: Buffer.from(payload) });

  test('several replies in one chunk, the empty reply among them', () => {
    const stream = Buffer.concat([reply(['k', 'v']), reply(), reply(['a', ''], ['', 'b'])]);
    assert.deepEqual(new ReplyDecoder().feed(stream), [
      [packet('k', 'v')], [], [packet('a', ''), packet('', 'b')],
    ]);
  });

  test('a reply split at every byte, in every pair of pieces and byte by byte', () => {
    const stream = Buffer.concat([reply(['key', 'payload'], ['key', '']), reply()]);
    const expected = new ReplyDecoder().feed(stream);
    for (let cut = 0; cut <= stream.length; cut += 1) {
      const decoder = new ReplyDecoder();
      const got = [...decoder.feed(stream.subarray(0, cut)), ...decoder.feed(stream.subarray(cut))];
      assert.deepEqual(got, expected, `cut at ${cut}`);
      assert.equal(decoder.pendingBytes, 0);
    }
    const decoder = new ReplyDecoder();
    const got = [];
    for (const byte of stream) got.push(...decoder.feed(Buffer.from([byte])));
    assert.deepEqual(got, expected);
  });

  test('pendingBytes counts a reply not yet whole', () => {
    const decoder = new ReplyDecoder();
    const stream = reply(['k', 'v']);
    assert.deepEqual(decoder.feed(stream.subarray(0, 5)), []);
    assert.equal(decoder.pendingBytes, 5);
    assert.deepEqual(decoder.feed(stream.subarray(5)), [[packet('k', 'v')]]);
    assert.equal(decoder.pendingBytes, 0);
  });

  test('incomingCount: the count of the reply being read, known from its first two bytes', () => {
    const decoder = new ReplyDecoder();
    assert.equal(decoder.incomingCount, null);
    decoder.feed(Buffer.from('-'));
    assert.equal(decoder.incomingCount, null, 'one byte is no count yet');
    decoder.feed(Buffer.from('ERR unknown command\r\n'));
    assert.equal(decoder.incomingCount, 0x2d45); // "-E", the start of a Redis error line

    const pinpriq = new ReplyDecoder();
    assert.deepEqual(pinpriq.feed(Buffer.concat([reply(['k', 'v']), reply(), reply(['a', 'b']).subarray(0, 3)])),
      [[packet('k', 'v')], []]);
    assert.equal(pinpriq.incomingCount, 1, 'the third reply, begun');
    pinpriq.feed(reply(['a', 'b']).subarray(3));
    assert.equal(pinpriq.incomingCount, null, 'between replies');
  });

  test('returned packets do not share memory with the chunk fed in', () => {
    const chunk = reply(['k', 'v']);
    const [[got]] = new ReplyDecoder().feed(chunk);
    chunk.fill(0);
    assert.deepEqual(got, packet('k', 'v'));
  });
});

describe('leases (protocol 1.1)', () => {
  const hex = (buffer) => buffer.toString('hex');

  test('the five lease frames, byte for byte as the protocol lays them out', () => {
    // 52 | lease ms u32 | queue_len u16 | queue: the time before the name
    assert.equal(hex(encodeReserve('jobs', { leaseMs: 30_000 })), `52000075300004${hex(Buffer.from('jobs'))}`);
    assert.equal(hex(encodeReserve('')), '52000000000000');
    assert.equal(hex(encodeLeasedSubscribe('q', { leaseMs: 100 })), `53000000640001${hex(Buffer.from('q'))}`);
    assert.equal(hex(encodeAck(1)), '4b0000000000000001');
    assert.equal(hex(encodeRelease(258, { delayMs: 1500 })), '4e0000000000000102000005dc');
    assert.equal(hex(encodeTouch(3)), '54000000000000000300000000');
  });

  test('lease times, delays and ids out of range are RangeErrors naming them', () => {
    assertRangeError(() => encodeReserve('q', { leaseMs: 86_400_001 }), 'leaseMs');
    assertRangeError(() => encodeLeasedSubscribe('q', { leaseMs: -1 }), 'leaseMs');
    assertRangeError(() => encodeRelease(1, { delayMs: 86_400_001 }), 'delayMs');
    assertRangeError(() => encodeTouch(1, { leaseMs: 1.5 }), 'leaseMs');
    assertRangeError(() => encodeAck(-1), 'leaseId');
    assert.equal(encodeReserve('q', { leaseMs: 86_400_000 }).readUInt32BE(1), 86_400_000);
  });

  test('the decoder reads the 11-byte lease header where it is told to, in any chunking', () => {
    const stream = Buffer.concat([
      Buffer.from('0000000000000007 02 0002 0001 0001 6b 61 0001 0000 6b'.replaceAll(' ', ''), 'hex'),
      Buffer.from('0001 0001 0000 6a'.replaceAll(' ', ''), 'hex'), // a pop reply between
      Buffer.from('0000000000000007 01 0000'.replaceAll(' ', ''), 'hex'),
    ]);
    for (const size of [stream.length, 1, 3]) {
      const decoder = new ReplyDecoder({ leased: (position) => position !== 1 });
      const messages = [];
      for (let at = 0; at < stream.length; at += size) {
        messages.push(...decoder.feed(stream.subarray(at, at + size)));
      }
      assert.deepEqual(messages, [
        { leaseId: 7, attempt: 2, packets: [
          { key: Buffer.from('k'), payload: Buffer.from('a') },
          { key: Buffer.from('k'), payload: Buffer.alloc(0) },
        ] },
        [{ key: Buffer.from('j'), payload: Buffer.alloc(0) }],
        { leaseId: 7, attempt: 1, packets: [] },
      ]);
      assert.equal(decoder.pendingBytes, 0);
    }
  });
});
