// The codec against the wire fixtures: every client frame the fixtures send is rebuilt with
// this package's encoder from its fields and must come out byte for byte the same; every
// stream of replies the fixtures expect must decode whole, in one piece or split anywhere.
// The bytes come from the fixture files themselves (read with test-support/fixtures.js).

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';

import {
  OPCODE, ReplyDecoder, encodeAck, encodeAuth, encodeLeasedSubscribe, encodePop, encodePush,
  encodeReady, encodeRelease, encodeReserve, encodeSubscribe, encodeSync, encodeTouch,
  encodeUnsubscribe,
} from '../src/wire.js';
import { fixtureNames, readFixture, streamsByConnection } from '../test-support/fixtures.js';

const NAMES = fixtureNames();
// Parsed once: reply-max-packets alone holds 65,537 pushes.
const FIXTURES = new Map(NAMES.map((name) => [name, readFixture(name)]));

/**
 * Splits what a connection sends into client frames, reading each layout on its own (not with
 * the package's code). Stops at a byte that is no opcode or at a frame cut short.
 * @param {Buffer} stream
 * @returns {{ frames: { opcode: number, bytes: Buffer, fields: object }[], rest: Buffer }}
 */
function splitClientFrames(stream) {
  const frames = [];
  let at = 0;
  for (;;) {
    const frame = readClientFrame(stream, at);
    if (frame === null) break;
    frames.push(frame);
    at += frame.bytes.length;
  }
  return { frames, rest: stream.subarray(at) };
}

function readClientFrame(stream, at) {
  const u16 = (offset) => (offset + 2 <= stream.length ? stream.readUInt16BE(offset) : null);
  const whole = (end, fields) => (end <= stream.length
    ? { opcode: stream[at], bytes: stream.subarray(at, end), fields }
    : null);
  if (at >= stream.length) return null;
  switch (stream[at]) {
    case OPCODE.READY:
    case OPCODE.SYNC:
      return whole(at + 1, {});
    case OPCODE.POP:
    case OPCODE.SUBSCRIBE:
    case OPCODE.UNSUBSCRIBE:
    case OPCODE.AUTH: { // the same layout: one u16-length byte string (auth's is the token)
      const length = u16(at + 1);
      if (length === null) return null;
      return whole(at + 3 + length, { queue: stream.subarray(at + 3, at + 3 + length) });
    }
    case OPCODE.RESERVE:
    case OPCODE.LEASED_SUBSCRIBE: { // a u32 lease time, then the queue's length and name
      const length = u16(at + 5);
      if (length === null) return null;
      return whole(at + 7 + length, {
        leaseMs: stream.readUInt32BE(at + 1), queue: stream.subarray(at + 7, at + 7 + length),
      });
    }
    case OPCODE.ACK:
      return at + 9 <= stream.length
        ? whole(at + 9, { leaseId: Number(stream.readBigUInt64BE(at + 1)) })
        : null;
    case OPCODE.RELEASE:
    case OPCODE.TOUCH: {
      if (at + 13 > stream.length) return null;
      const ms = stream.readUInt32BE(at + 9);
      return whole(at + 13, { leaseId: Number(stream.readBigUInt64BE(at + 1)), ms });
    }
    case OPCODE.PUSH:
    case OPCODE.PUSH_OPTIONS: { // 71: the TTL a u32, then a u32 delay (protocol 1.2)
      const options = stream[at] === OPCODE.PUSH_OPTIONS;
      const header = options ? 16 : 10;
      if (at + header > stream.length) return null;
      const queueLength = stream.readUInt16BE(at + 1);
      const ttlMs = options ? stream.readUInt32BE(at + 3) : stream.readUInt16BE(at + 3);
      const delayMs = options ? stream.readUInt32BE(at + 7) : 0;
      const prio = stream[at + header - 5];
      const keyLength = stream.readUInt16BE(at + header - 4);
      const payloadLength = stream.readUInt16BE(at + header - 2);
      const key = at + header;
      const payload = key + keyLength;
      const queue = payload + payloadLength;
      const end = queue + queueLength;
      return whole(end, {
        key: stream.subarray(key, payload),
        payload: stream.subarray(payload, queue),
        queue: stream.subarray(queue, end),
        ttlMs,
        delayMs,
        prio,
      });
    }
    default:
      return null; // not an opcode
  }
}

/** The package's encoding of a frame's fields. */
function encodeAgain({ opcode, fields }) {
  switch (opcode) {
    case OPCODE.PUSH:
    case OPCODE.PUSH_OPTIONS:
      return encodePush(fields.queue, fields.key, fields.payload, {
        ttlMs: fields.ttlMs, prio: fields.prio, delayMs: fields.delayMs,
      });
    case OPCODE.POP: return encodePop(fields.queue);
    case OPCODE.SUBSCRIBE: return encodeSubscribe(fields.queue);
    case OPCODE.UNSUBSCRIBE: return encodeUnsubscribe(fields.queue);
    case OPCODE.READY: return encodeReady();
    case OPCODE.SYNC: return encodeSync();
    case OPCODE.AUTH: return encodeAuth(fields.queue);
    case OPCODE.RESERVE: return encodeReserve(fields.queue, { leaseMs: fields.leaseMs });
    case OPCODE.LEASED_SUBSCRIBE:
      return encodeLeasedSubscribe(fields.queue, { leaseMs: fields.leaseMs });
    case OPCODE.ACK: return encodeAck(fields.leaseId);
    case OPCODE.RELEASE: return encodeRelease(fields.leaseId, { delayMs: fields.ms });
    case OPCODE.TOUCH: return encodeTouch(fields.leaseId, { leaseMs: fields.ms });
    default: throw new Error(`opcode ${opcode}`);
  }
}

/** The wire form of decoded replies, built here to check the decoder lost nothing. */
function serializeReplies(replies) {
  const parts = [];
  for (const reply of replies) {
    const packets = Array.isArray(reply) ? reply : reply.packets;
    if (Array.isArray(reply)) {
      const count = Buffer.alloc(2);
      count.writeUInt16BE(reply.length);
      parts.push(count);
    } else { // a lease message: lease id u64, attempt u8, count u16
      const header = Buffer.alloc(11);
      header.writeBigUInt64BE(BigInt(reply.leaseId), 0);
      header[8] = reply.attempt;
      header.writeUInt16BE(packets.length, 9);
      parts.push(header);
    }
    for (const { key, payload } of packets) {
      const header = Buffer.alloc(4);
      header.writeUInt16BE(key.length, 0);
      header.writeUInt16BE(payload.length, 2);
      parts.push(header, key, payload);
    }
  }
  return Buffer.concat(parts);
}

/**
 * Decodes a connection's expected stream, fed in pieces cut at `cuts`, reading each message
 * with the header its place calls for, which follows from what the connection sent (read here
 * on its own). On a leased connection (one that sent 53), every message has the 11-byte lease
 * header except the replies to what it sent before the 53. On any other, the n-th message is
 * the reply to its n-th pop, sync, reserve, ack, release or touch (the fixtures never mix
 * lease frames with a plain subscription's deliveries), and has the lease header for the last
 * four.
 */
function decodeInPieces(stream, cuts, sent = Buffer.alloc(0)) {
  const owed = []; // per request answered, in order: whether its answer has the lease header
  let before = null; // requests sent before the connection became leased
  for (const { opcode } of splitClientFrames(sent).frames) {
    if (opcode === OPCODE.LEASED_SUBSCRIBE) before ??= owed.length;
    else if (opcode === OPCODE.POP || opcode === OPCODE.SYNC) owed.push(before !== null);
    else if ([OPCODE.RESERVE, OPCODE.ACK, OPCODE.RELEASE, OPCODE.TOUCH].includes(opcode)) {
      owed.push(true);
    }
  }
  const leased = (position) => (before === null ? owed[position] ?? false : position >= before);
  const decoder = new ReplyDecoder({ leased });
  const replies = [];
  let from = 0;
  for (const cut of [...cuts, stream.length]) {
    replies.push(...decoder.feed(stream.subarray(from, cut)));
    from = cut;
  }
  return { replies, pendingBytes: decoder.pendingBytes };
}

test('the fixture directory holds the fixtures', () => {
  assert.ok(NAMES.length >= 30, `only ${NAMES.length} fixtures in wire-fixtures/`);
  assert.ok(NAMES.includes('push-pop'));
});

describe('encoder: every client frame of every fixture, byte for byte', () => {
  const opcodesSeen = new Set();

  for (const name of NAMES) {
    test(name, () => {
      const steps = FIXTURES.get(name);
      for (const [connection, { sent }] of streamsByConnection(steps)) {
        const { frames, rest } = splitClientFrames(sent);
        for (const frame of frames) {
          opcodesSeen.add(frame.opcode);
          if ((frame.fields.leaseMs ?? frame.fields.ms ?? 0) > 86_400_000
            || (frame.fields.delayMs ?? 0) > 2_592_000_000) {
            // Malformed (the fixture expects a close): the encoder refuses to write it.
            assert.throws(() => encodeAgain(frame), RangeError);
            continue;
          }
          const encoded = encodeAgain(frame);
          if (frame.opcode === OPCODE.PUSH_OPTIONS && encoded[0] === OPCODE.PUSH) {
            // A 71 that 1.0 can say (no delay, a short TTL): the encoder writes it as the 70
            // it is equal to (decision 21), with the same fields.
            assert.deepEqual(readClientFrame(encoded, 0).fields, frame.fields, name);
            continue;
          }
          // Buffer.equals first: assert.deepEqual on 65,537 frames is needlessly slow.
          if (!encoded.equals(frame.bytes)) {
            assert.deepEqual(encoded, frame.bytes, `${name}, connection ${connection}`);
          }
        }
        if (rest.length > 0) {
          // Bytes that are no whole frame (an unknown opcode, a frame cut short) may only come
          // last on a connection the fixture then closes or expects the server to close.
          const ends = steps.some((s) => s.connection === connection
            && (s.verb === 'close' || s.verb === 'expect-closed'));
          assert.ok(ends, `${name}, ${connection}: ${rest.length} bytes are no frame`);
        }
      }
    });
  }

  test('the fixtures used every opcode', () => {
    assert.deepEqual([...opcodesSeen].sort(), Object.values(OPCODE).sort());
  });
});

describe('decoder: every reply stream of every fixture', () => {
  const streams = NAMES.flatMap((name) => [...streamsByConnection(FIXTURES.get(name))]
    .filter(([, { expected }]) => expected.length > 0)
    .map(([connection, { sent, expected }]) => ({
      label: `${name} ${connection}`, sent, expected,
    })));

  test('in one piece: whole replies, nothing left over, nothing lost', () => {
    assert.ok(streams.length > 30);
    for (const { label, sent, expected } of streams) {
      const { replies, pendingBytes } = decodeInPieces(expected, [], sent);
      assert.equal(pendingBytes, 0, label);
      assert.ok(replies.length > 0, label);
      assert.deepEqual(serializeReplies(replies), expected, label);
    }
  });

  test('one byte per read, as a server may send them', () => {
    for (const { label, sent, expected } of streams) {
      const whole = decodeInPieces(expected, [], sent).replies;
      const cuts = Array.from({ length: expected.length - 1 }, (_, i) => i + 1);
      const { replies, pendingBytes } = decodeInPieces(expected, cuts, sent);
      assert.equal(pendingBytes, 0, label);
      assert.equal(replies.length, whole.length, label);
      // Compared in wire form: the same bytes back means the same packets, in the same replies.
      assert.ok(serializeReplies(replies).equals(expected), label);
    }
  });

  test('split in two at every byte', () => {
    for (const { label, sent, expected } of streams.filter((s) => s.expected.length <= 4096)) {
      const whole = decodeInPieces(expected, [], sent).replies;
      for (let cut = 0; cut <= expected.length; cut += 1) {
        const { replies, pendingBytes } = decodeInPieces(expected, [cut], sent);
        assert.equal(pendingBytes, 0, `${label}, cut at ${cut}`);
        assert.deepEqual(replies, whole, `${label}, cut at ${cut}`);
      }
    }
  });
});
