// The pinpriq wire format (protocol 1.0, the sync, auth and lease frames of 1.1, and 1.2's
// push with options, docs/protocol.md), sans I/O: functions from arguments to frame bytes, and a decoder from
// received bytes to replies.
// Nothing here touches a socket, so every byte layout lives in this one file and can be tested
// without a server.

/** Opcodes of the client frames: the five of protocol 1.0, sync, auth and the leases from
 * 1.1, and 1.2's push with options. */
export const OPCODE = Object.freeze({
  PUSH: 0x70,
  PUSH_OPTIONS: 0x71,
  POP: 0x50,
  SUBSCRIBE: 0x73,
  UNSUBSCRIBE: 0x75,
  READY: 0x41,
  SYNC: 0x21,
  AUTH: 0x61,
  RESERVE: 0x52,
  ACK: 0x4b,
  RELEASE: 0x4e,
  TOUCH: 0x54,
  LEASED_SUBSCRIBE: 0x53,
});

/** Largest queue name, key or payload, in bytes (a u16 length). */
export const MAX_FIELD_BYTES = 0xffff;
/** Largest TTL in milliseconds (a u32, protocol 1.2); 0 means the packet never expires. */
export const MAX_TTL_MS = 0xffff_ffff;
/** Largest TTL a protocol 1.0 push (70) can carry (a u16): a longer one needs a 71. */
export const MAX_TTL_MS_1_0 = 0xffff;
/** Longest delay of a push in milliseconds (30 days, protocol 1.2); 0 queues it at once. */
export const MAX_DELAY_MS = 2_592_000_000;
/** Lowest priority (a u8); 1 is the highest, 0 is never selected on its own. */
export const MAX_PRIO = 0xff;
/** Longest lease time or release delay in milliseconds (24 h); 0 means the server's default. */
export const MAX_LEASE_MS = 86_400_000;
/** Bytes of the header of every message about a lease: lease id u64, attempt u8, count u16. */
export const LEASE_HEADER_BYTES = 11;

/**
 * A queue name, key or payload: a string (sent as UTF-8) or bytes.
 * @typedef {string | Uint8Array} Data
 */

/**
 * One packet of a reply.
 * @typedef {{ key: Buffer, payload: Buffer }} Packet
 */

/**
 * A message with the 11-byte lease header (protocol 1.1): a reserve reply or leased delivery
 * (the lease's id, its attempt, its packets), or the answer to an ack, release or touch (the
 * lease id, `attempt` holding the status, 1 if the lease was live, and no packets).
 * @typedef {{ leaseId: number, attempt: number, packets: Packet[] }} LeaseMessage
 */

/**
 * A field as bytes, checked against the u16 length limit.
 * @param {string} field the argument's name, for the error message
 * @param {Data} value
 * @returns {Buffer}
 */
export function toBytes(field, value) {
  let bytes;
  if (typeof value === 'string') {
    bytes = Buffer.from(value, 'utf8');
  } else if (value instanceof Uint8Array) {
    // A view, not a copy: the frame encoder copies it into the frame anyway.
    bytes = Buffer.from(value.buffer, value.byteOffset, value.byteLength);
  } else {
    throw new TypeError(`${field} must be a string, Buffer or Uint8Array, not ${describe(value)}`);
  }
  if (bytes.length > MAX_FIELD_BYTES) {
    throw new RangeError(
      `${field} is ${bytes.length} bytes; the limit is ${MAX_FIELD_BYTES} bytes`,
    );
  }
  return bytes;
}

/**
 * An integer option, checked against its range.
 * @param {string} field
 * @param {unknown} value
 * @param {number} min
 * @param {number} max `Infinity` for no upper bound
 * @returns {number}
 */
export function checkInteger(field, value, min, max) {
  if (typeof value !== 'number') {
    throw new TypeError(`${field} must be a number, not ${describe(value)}`);
  }
  if (!Number.isInteger(value) || value < min || value > max) {
    const range = max === Infinity ? `>= ${min}` : `in ${min}..${max}`;
    throw new RangeError(`${field} must be an integer ${range}, not ${value}`);
  }
  return value;
}

function describe(value) {
  if (value === null) return 'null';
  if (typeof value === 'object') return value.constructor?.name ?? 'object';
  return typeof value;
}

/**
 * The bytes of a push. The packet (its lengths, key and payload) comes before the queue name,
 * while the queue's length comes first: that is the protocol's order, not a mistake.
 * A push that protocol 1.0 can say (no delay, a TTL up to 65,535 ms) is a 70, which every
 * server takes; a longer TTL or a delay makes it a push with options, 71 (protocol 1.2).
 * @param {Data} queue
 * @param {Data} key
 * @param {Data} payload
 * @param {{ ttlMs?: number, prio?: number, delayMs?: number }} [options] ttlMs
 *   0..4294967295 (0: never expires, the default; counted from when the packet is due);
 *   prio 0..255 (1 highest, the default; 0 never selected on its own); delayMs
 *   0..2592000000 (30 days; 0, the default, queues it at once)
 * @returns {Buffer} one whole frame
 */
export function encodePush(queue, key, payload, { ttlMs = 0, prio = 1, delayMs = 0 } = {}) {
  const q = toBytes('queue', queue);
  const k = toBytes('key', key);
  const p = toBytes('payload', payload);
  checkInteger('ttlMs', ttlMs, 0, MAX_TTL_MS);
  checkInteger('prio', prio, 0, MAX_PRIO);
  checkInteger('delayMs', delayMs, 0, MAX_DELAY_MS);
  const options = delayMs > 0 || ttlMs > MAX_TTL_MS_1_0;
  // 70: u16 TTL (10-byte header); 71: u32 TTL, then u32 delay (16 bytes).
  let at = options ? 16 : 10;
  const frame = Buffer.allocUnsafe(at + k.length + p.length + q.length);
  frame[0] = options ? OPCODE.PUSH_OPTIONS : OPCODE.PUSH;
  frame.writeUInt16BE(q.length, 1);
  if (options) {
    frame.writeUInt32BE(ttlMs, 3);
    frame.writeUInt32BE(delayMs, 7);
  } else {
    frame.writeUInt16BE(ttlMs, 3);
  }
  frame[at - 5] = prio;
  frame.writeUInt16BE(k.length, at - 4);
  frame.writeUInt16BE(p.length, at - 2);
  at += k.copy(frame, at);
  at += p.copy(frame, at);
  q.copy(frame, at);
  return frame;
}

/**
 * A frame made of an opcode and a queue name: pop, subscribe and unsubscribe share it.
 * @param {number} opcode
 * @param {Data} queue
 * @returns {Buffer}
 */
function queueFrame(opcode, queue) {
  const q = toBytes('queue', queue);
  const frame = Buffer.allocUnsafe(3 + q.length);
  frame[0] = opcode;
  frame.writeUInt16BE(q.length, 1);
  q.copy(frame, 3);
  return frame;
}

/** @param {Data} queue @returns {Buffer} a pop frame; the server answers it with one reply */
export const encodePop = (queue) => queueFrame(OPCODE.POP, queue);

/** @param {Data} queue @returns {Buffer} a subscribe frame (it grants no credit) */
export const encodeSubscribe = (queue) => queueFrame(OPCODE.SUBSCRIBE, queue);

/** @param {Data} queue @returns {Buffer} an unsubscribe frame (credits are kept) */
export const encodeUnsubscribe = (queue) => queueFrame(OPCODE.UNSUBSCRIBE, queue);

/**
 * Ready frames: each single byte 0x41 grants one delivery credit.
 * @param {number} [credits] how many, 1 by default
 * @returns {Buffer}
 */
export function encodeReady(credits = 1) {
  checkInteger('credits', credits, 0, Number.MAX_SAFE_INTEGER);
  return Buffer.alloc(credits, OPCODE.READY);
}

/**
 * A sync frame (protocol 1.1): the server answers it with the empty reply `00 00` once every
 * earlier frame of the connection has been applied. A 1.0 server closes the connection instead.
 * @returns {Buffer}
 */
export function encodeSync() {
  return Buffer.from([OPCODE.SYNC]);
}

/**
 * An auth frame (protocol 1.1, decision 12): the token a server with one wants first on every
 * connection. It answers `00 00` if the token is right; otherwise it closes the connection.
 * @param {Data} token
 * @returns {Buffer}
 */
export const encodeAuth = (token) => {
  const t = toBytes('token', token);
  const frame = Buffer.allocUnsafe(3 + t.length);
  frame[0] = OPCODE.AUTH;
  frame.writeUInt16BE(t.length, 1);
  t.copy(frame, 3);
  return frame;
};

/**
 * A frame of an opcode, a u32 lease time and a queue name: reserve and leased subscribe.
 * @param {number} opcode
 * @param {Data} queue
 * @param {number} leaseMs
 * @returns {Buffer}
 */
function timedQueueFrame(opcode, queue, leaseMs) {
  const q = toBytes('queue', queue);
  checkInteger('leaseMs', leaseMs, 0, MAX_LEASE_MS);
  const frame = Buffer.allocUnsafe(7 + q.length);
  frame[0] = opcode;
  frame.writeUInt32BE(leaseMs, 1);
  frame.writeUInt16BE(q.length, 5);
  q.copy(frame, 7);
  return frame;
}

/**
 * A reserve frame (protocol 1.1): lease what a pop would take. The lease time comes before the
 * queue name's length.
 * @param {Data} queue
 * @param {{ leaseMs?: number }} [options] 0..86400000 ms; 0 (the default): the server's default
 * @returns {Buffer}
 */
export function encodeReserve(queue, { leaseMs = 0 } = {}) {
  return timedQueueFrame(OPCODE.RESERVE, queue, leaseMs);
}

/**
 * A leased subscribe frame (protocol 1.1): a subscribe whose deliveries are leases.
 * @param {Data} queue
 * @param {{ leaseMs?: number }} [options] as for `encodeReserve`
 * @returns {Buffer}
 */
export function encodeLeasedSubscribe(queue, { leaseMs = 0 } = {}) {
  return timedQueueFrame(OPCODE.LEASED_SUBSCRIBE, queue, leaseMs);
}

/**
 * A lease id as the u64 it is on the wire. Ids count from 1 per connection, so a safe integer
 * holds any a server will send.
 * @param {unknown} leaseId
 * @returns {bigint}
 */
function leaseIdBits(leaseId) {
  return BigInt(checkInteger('leaseId', leaseId, 0, Number.MAX_SAFE_INTEGER));
}

/** A frame of an opcode, a lease id and (if `ms` is given) a u32 time. */
function leaseFrame(opcode, leaseId, field, ms) {
  const frame = Buffer.allocUnsafe(field === null ? 9 : 13);
  frame[0] = opcode;
  frame.writeBigUInt64BE(leaseIdBits(leaseId), 1);
  if (field !== null) frame.writeUInt32BE(checkInteger(field, ms, 0, MAX_LEASE_MS), 9);
  return frame;
}

/** @param {number} leaseId @returns {Buffer} an ack: the lease's packets are gone for good */
export const encodeAck = (leaseId) => leaseFrame(OPCODE.ACK, leaseId, null);

/**
 * A release: the lease ends now, its packets go back after `delayMs` (0: at once).
 * @param {number} leaseId
 * @param {{ delayMs?: number }} [options]
 * @returns {Buffer}
 */
export function encodeRelease(leaseId, { delayMs = 0 } = {}) {
  return leaseFrame(OPCODE.RELEASE, leaseId, 'delayMs', delayMs);
}

/**
 * A touch: the lease now ends `leaseMs` from now (0: the server's default).
 * @param {number} leaseId
 * @param {{ leaseMs?: number }} [options]
 * @returns {Buffer}
 */
export function encodeTouch(leaseId, { leaseMs = 0 } = {}) {
  return leaseFrame(OPCODE.TOUCH, leaseId, 'leaseMs', leaseMs);
}

/**
 * Turns the bytes a server sends into replies (a pop's answer or a subscription's delivery:
 * the same format). Bytes may arrive split anywhere; a reply is returned once it is whole.
 *
 * The decoder never concatenates its whole input on each call: it queues the chunks it is
 * given and only copies out the few bytes the next field needs, so feeding a large reply one
 * byte at a time stays linear.
 *
 * Messages about leases (protocol 1.1) have an 11-byte header instead of the 2-byte count. The
 * bytes do not say which comes next; the requests do. `leased(position)`, if given, is asked
 * at the start of each message, `position` counting the messages this decoder has completed
 * before it (0 for the first); when it says true the message is read with the lease header and
 * returned as a `LeaseMessage`.
 */
export class ReplyDecoder {
  /** @type {(position: number) => boolean} */
  #leased;
  /** messages completed so far */
  #position = 0;
  /** the header of the message being read, when it is a lease message */
  #lease = null;
  /** @type {Buffer[]} chunks received and not yet consumed */
  #chunks = [];
  /** index of the first unconsumed chunk in #chunks */
  #first = 0;
  /** bytes of #chunks[#first] already consumed */
  #offset = 0;
  /** unconsumed bytes across all chunks */
  #buffered = 0;
  /** @type {'count' | 'header' | 'body'} what the next bytes are */
  #state = 'count';
  /** the packet count of the current reply, as its first two bytes said */
  #count = 0;
  /** packets still to read in the current reply */
  #remaining = 0;
  #keyLength = 0;
  #payloadLength = 0;
  /** @type {Packet[]} the reply being read */
  #packets = [];
  /** bytes already taken for the reply being read */
  #partial = 0;

  /** @param {{ leased?: (position: number) => boolean }} [options] */
  constructor({ leased = () => false } = {}) {
    this.#leased = leased;
  }

  /**
   * Bytes received but not yet part of a returned reply: 0 when the stream ended on a reply
   * boundary.
   * @returns {number}
   */
  get pendingBytes() {
    return this.#buffered + this.#partial;
  }

  /**
   * The packet count of the reply being read, once its two count bytes have arrived and
   * before the reply is whole; null between replies. It lets a caller judge a reply by its
   * first two bytes (a sync's answer must be `00 00`) without waiting for bytes that a server
   * of another kind may never send.
   * @returns {number | null}
   */
  get incomingCount() {
    return this.#state === 'count' ? null : this.#count;
  }

  /**
   * Give the decoder some received bytes; the decoder keeps them, so do not modify the chunk
   * afterwards.
   * @param {Uint8Array} chunk
   * @returns {(Packet[] | LeaseMessage)[]} every reply completed by these bytes, in order
   *   (often none)
   */
  feed(chunk) {
    if (chunk.length > 0) {
      this.#chunks.push(Buffer.isBuffer(chunk)
        ? chunk
        : Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength));
      this.#buffered += chunk.length;
    }
    const replies = [];
    for (;;) {
      const reply = this.#step();
      if (reply === null) break;
      if (reply !== undefined) replies.push(reply);
    }
    return replies;
  }

  /**
   * Reads one field if its bytes are all there.
   * @returns {Packet[] | undefined | null} a completed reply; undefined if a field was read but
   *   the reply goes on; null if more bytes are needed
   */
  #step() {
    if (this.#state === 'count') {
      if (this.#leased(this.#position)) {
        if (this.#buffered < LEASE_HEADER_BYTES) return null;
        const header = this.#take(LEASE_HEADER_BYTES);
        this.#lease = {
          leaseId: Number(header.readBigUInt64BE(0)),
          attempt: header[8],
        };
        this.#count = header.readUInt16BE(9);
      } else {
        if (this.#buffered < 2) return null;
        this.#count = this.#take(2).readUInt16BE(0);
        this.#lease = null;
      }
      this.#remaining = this.#count;
      this.#packets = [];
      this.#state = 'header';
    } else if (this.#state === 'header') {
      if (this.#buffered < 4) return null;
      const header = this.#take(4);
      this.#keyLength = header.readUInt16BE(0);
      this.#payloadLength = header.readUInt16BE(2);
      this.#state = 'body';
    } else {
      const length = this.#keyLength + this.#payloadLength;
      if (this.#buffered < length) return null;
      const body = this.#take(length);
      // Copies, so a small key never keeps a large received chunk alive.
      this.#packets.push({
        key: Buffer.from(body.subarray(0, this.#keyLength)),
        payload: Buffer.from(body.subarray(this.#keyLength)),
      });
      this.#remaining -= 1;
      this.#state = 'header';
    }
    if (this.#state === 'header' && this.#remaining === 0) {
      this.#state = 'count';
      this.#partial = 0;
      this.#position += 1;
      const reply = this.#packets;
      this.#packets = [];
      return this.#lease === null ? reply : { ...this.#lease, packets: reply };
    }
    return undefined;
  }

  /**
   * Removes the next n buffered bytes (n <= #buffered) and returns them: a view when they lie
   * in one chunk, a copy when they span several.
   * @param {number} n
   * @returns {Buffer}
   */
  #take(n) {
    if (n === 0) return Buffer.alloc(0);
    this.#buffered -= n;
    this.#partial += n;
    const head = this.#chunks[this.#first];
    if (head.length - this.#offset >= n) {
      const bytes = head.subarray(this.#offset, this.#offset + n);
      this.#advance(n);
      return bytes;
    }
    const bytes = Buffer.allocUnsafe(n);
    let filled = 0;
    while (filled < n) {
      const chunk = this.#chunks[this.#first];
      const count = Math.min(chunk.length - this.#offset, n - filled);
      chunk.copy(bytes, filled, this.#offset, this.#offset + count);
      filled += count;
      this.#advance(count);
    }
    return bytes;
  }

  /** Consumes count bytes of the head chunk, dropping chunks once they are used up. */
  #advance(count) {
    this.#offset += count;
    if (this.#offset < this.#chunks[this.#first].length) return;
    this.#first += 1;
    this.#offset = 0;
    if (this.#first === this.#chunks.length) {
      this.#chunks = [];
      this.#first = 0;
    } else if (this.#first >= 1024 && this.#first * 2 >= this.#chunks.length) {
      // Compact now and then, so a long run of tiny chunks does not grow the array forever.
      this.#chunks = this.#chunks.slice(this.#first);
      this.#first = 0;
    }
  }
}
