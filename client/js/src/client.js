// The socket layer: a pinpriq connection for Node.js on top of the sans-I/O codec in wire.js.
//
// One PinpriqClient is one TCP connection that any number of callers may use at once. Requests
// are pipelined: each call writes its whole frame with a single socket.write (Node keeps writes
// in call order and never splits one write among others, so frames never interleave), and each
// pop or sync appends its resolver to a FIFO in the same synchronous step. The server answers
// pops and syncs in request order (protocol decisions 8 and 11), so the reply parser simply
// hands each reply to the oldest resolver. A pop or sync that times out stays in the FIFO,
// marked abandoned, so the reply it was owed still lands in its place and the connection stays
// in step.
//
// Subscriptions get a connection of their own, because a delivery and a pop reply are the same
// bytes. They keep `prefetch` delivery credits outstanding: `prefetch` up front, then one more
// each time the consumer takes a delivery, but never more than `limit` in all.
//
// Leases (protocol 1.1): a reserve, ack, release or touch is answered with the 11-byte lease
// header, which the reply decoder reads when the FIFO says that request's answer is next. A
// Lease acks, releases and touches on the connection that holds it: the client's own for
// reserve(), the subscription's for a leased subscribe(), where deliveries (count > 0) and
// answers (count 0) share the stream and are told apart by their count.

import net from 'node:net';
import tls from 'node:tls';
import {
  MAX_LEASE_MS, OPCODE, ReplyDecoder, checkInteger, encodeAck, encodeAuth, encodeLeasedSubscribe,
  encodePop, encodePush, encodeReady, encodeRelease, encodeReserve, encodeSubscribe, encodeSync,
  encodeTouch, toBytes,
} from './wire.js';

/** @typedef {import('./wire.js').Data} Data */
/** @typedef {import('./wire.js').Packet} Packet */
/** @typedef {import('./wire.js').LeaseMessage} LeaseMessage */

export const DEFAULT_HOST = '127.0.0.1';
export const DEFAULT_PORT = 7000;
/** Milliseconds to wait for a connection or an answer, unless `timeout` says otherwise. */
export const DEFAULT_TIMEOUT = 10_000;
/** Most credits a subscription keeps outstanding (each is one byte the server must count). */
export const MAX_PREFETCH = 0xffff;
/** The lease time `work` asks for, in milliseconds: it touches the lease at half of it. */
export const DEFAULT_WORK_LEASE_MS = 30_000;
// setTimeout fires at once for delays above this, so longer timeouts mean "no limit".
const MAX_TIMER_MS = 2 ** 31 - 1;
// A server beyond its connection limit accepts a connection and closes (or resets) it before
// sending anything. A close that quick, with no byte received, is reported as such.
const CLOSED_AT_ONCE_MS = 1000;
const CLOSED_AT_ONCE = 'the server closed the connection at once (it may be at its connection '
  + 'limit, want a token or TLS, or refuse clients from other hosts)';
// A server that refuses a token closes the connection about 500 ms after the auth, so that
// tokens cannot be guessed fast: a close sooner than this did not judge the token.
const TOKEN_JUDGED_MS = 400;
/** The environment variable the token is read from when the `token` option is not given. */
export const TOKEN_VARIABLE = 'PINPRIQ_AUTH_TOKEN';

const REASONS = {
  ECONNREFUSED: 'connection refused',
  ECONNRESET: 'connection reset',
  EHOSTUNREACH: 'host unreachable',
  ENETUNREACH: 'network unreachable',
  ENOTFOUND: 'host not found',
  EAI_AGAIN: 'host name lookup failed',
  EPIPE: 'broken pipe',
};

/**
 * The base of the errors this client raises about a server: catch it to catch them all.
 * Arguments a call refuses before sending anything are `RangeError`s and `TypeError`s instead.
 * The message names the server as `host:port`.
 */
export class PinpriqError extends Error {
  /**
   * @param {string} message
   * @param {{ host: string, port: number, code?: string, cause?: unknown }} details
   */
  constructor(message, { host, port, code, cause }) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = 'PinpriqError';
    this.host = host;
    this.port = port;
    this.address = formatAddress(host, port);
    /** The system error code (such as `ECONNREFUSED`), when there was one. */
    this.code = code;
  }
}

/**
 * The server could not be reached, or the connection broke or was closed. The message names
 * the server as `host:port`.
 */
export class PinpriqConnectionError extends PinpriqError {
  /**
   * @param {string} message
   * @param {{ host: string, port: number, code?: string, cause?: unknown }} details
   */
  constructor(message, details) {
    super(message, details);
    this.name = 'PinpriqConnectionError';
  }
}

/** No connection or answer within the client's `timeout`. The message names the server. */
export class PinpriqTimeoutError extends PinpriqError {
  /** @param {string} message @param {{ host: string, port: number }} details */
  constructor(message, { host, port }) {
    super(message, { host, port, code: 'ETIMEDOUT' });
    this.name = 'PinpriqTimeoutError';
  }
}

/**
 * The server answered in a way no pinpriq server does: a sync answered with anything but
 * `00 00`, as another kind of server (Redis, HTTP) would. The client is closed.
 */
export class PinpriqProtocolError extends PinpriqError {
  /** @param {string} message @param {{ host: string, port: number }} details */
  constructor(message, { host, port }) {
    super(message, { host, port });
    this.name = 'PinpriqProtocolError';
  }
}

/** @param {string} host @param {number} port */
export function formatAddress(host, port) {
  return host.includes(':') ? `[${host}]:${port}` : `${host}:${port}`;
}

/**
 * Options of `PinpriqClient.connect`.
 * @typedef {object} ConnectOptions
 * @property {string} [host] default `127.0.0.1`
 * @property {number} [port] default 7000
 * @property {number} [timeout] milliseconds for connecting and for each call, default 10000;
 *   0 waits forever
 * @property {string | Uint8Array | null} [token] presented first on every connection (protocol
 *   1.1 auth); default: the PINPRIQ_AUTH_TOKEN environment variable, if set; `null` for none
 * @property {boolean | import('node:tls').ConnectionOptions} [tls] speak TLS: `true` trusts
 *   the system's CAs and checks the host name; an object is passed to `tls.connect` (`ca`,
 *   `cert`, `key`, ...)
 */

/** Where to connect and how long to wait: checked once, shared by a client's connections. */
class Endpoint {
  /** @param {ConnectOptions} options */
  constructor({
    host = DEFAULT_HOST, port = DEFAULT_PORT, timeout = DEFAULT_TIMEOUT,
    token = process.env[TOKEN_VARIABLE] || null, tls: tlsOption = false,
  } = {}) {
    if (typeof host !== 'string' || host === '') {
      throw new TypeError('host must be a non-empty string');
    }
    this.token = token === null ? null : toBytes('token', token);
    if (typeof tlsOption !== 'boolean' && (typeof tlsOption !== 'object' || tlsOption === null)) {
      throw new TypeError('tls must be true, false or an object of tls.connect options');
    }
    this.tls = tlsOption === false ? null : { ...(tlsOption === true ? {} : tlsOption) };
    this.host = host;
    this.port = checkInteger('port', port, 1, 65535);
    if (typeof timeout !== 'number' || !(timeout >= 0)) {
      throw new RangeError(`timeout must be a number of milliseconds >= 0, not ${timeout}`);
    }
    this.timeout = timeout;
    this.address = formatAddress(host, this.port);
  }

  /** @param {string} message */
  connectionError(message, details = {}) {
    return new PinpriqConnectionError(message, { host: this.host, port: this.port, ...details });
  }

  /**
   * Races `promise` against the timeout; on expiry calls `onTimeout` and rejects.
   * @template T
   * @param {Promise<T>} promise
   * @param {string} what the start of the message, such as `pop from`
   * @param {() => void} [onTimeout]
   * @returns {Promise<T>}
   */
  limit(promise, what, onTimeout) {
    if (this.timeout === 0 || this.timeout > MAX_TIMER_MS) return promise;
    let timer;
    const expiry = new Promise((_, reject) => {
      timer = setTimeout(() => {
        onTimeout?.();
        reject(new PinpriqTimeoutError(
          `${what} ${this.address}: no answer within ${this.timeout} ms`, this,
        ));
      }, this.timeout);
    });
    return Promise.race([promise, expiry]).finally(() => clearTimeout(timer));
  }

  /**
   * A connected socket, or a PinpriqConnectionError / PinpriqTimeoutError naming the address.
   * @returns {Promise<net.Socket>}
   */
  async open() {
    const socket = this.tls === null
      ? net.connect({ host: this.host, port: this.port })
      : tls.connect({
        host: this.host,
        port: this.port,
        // SNI takes host names only; the certificate is checked against the host either way.
        servername: net.isIP(this.host) ? undefined : this.host,
        ...this.tls,
      });
    let onError;
    let onClose;
    const connected = new Promise((resolve, reject) => {
      socket.once(this.tls === null ? 'connect' : 'secureConnect', resolve);
      onError = (error) => {
        reject(this.connectionError(`cannot connect to ${this.address}: ${this.#reason(error)}`, {
          code: error.code, cause: error,
        }));
      };
      // A TLS server that closes before the handshake ends (a plain pinpriq server does).
      onClose = () => reject(this.connectionError(
        `cannot connect to ${this.address}: ${this.tls === null ? CLOSED_AT_ONCE
          : 'the server closed the connection during the TLS handshake (does it speak TLS?)'}`,
      ));
      socket.once('error', onError);
      socket.once('close', onClose);
    });
    try {
      await this.limit(connected, 'cannot connect to', () => socket.destroy());
    } finally {
      socket.removeListener('error', onError);
      socket.removeListener('close', onClose);
    }
    // Frames are small and often answered at once: don't let Nagle's algorithm hold them back.
    socket.setNoDelay(true);
    if (this.token !== null) await this.#authenticate(socket);
    return socket;
  }

  /** @param {Error & { code?: string }} error */
  #reason(error) {
    // A reset while connecting: the server accepted the connection and reset it at once.
    if (error.code === 'ECONNRESET') return CLOSED_AT_ONCE;
    if (this.tls !== null && (error.code?.startsWith('ERR_TLS') || error.code?.startsWith('ERR_SSL')
      || /certificate|self.signed|altnames|SSL/i.test(error.message))) {
      return `TLS handshake failed: ${error.message}`;
    }
    return REASONS[error.code] ?? error.code ?? error.message;
  }

  /**
   * Presents the token and waits for its `00 00`: a server that does not take it closes the
   * connection, which is reported as such.
   * @param {net.Socket} socket
   */
  async #authenticate(socket) {
    const handlers = {};
    const answered = new Promise((resolve, reject) => {
      let received = Buffer.alloc(0);
      handlers.data = (chunk) => {
        received = Buffer.concat([received, chunk]);
        if (received.length < 2) return;
        if (received[0] === 0 && received[1] === 0 && received.length === 2) resolve();
        else {
          reject(new PinpriqProtocolError(
            `the server at ${this.address} did not answer like a pinpriq 1.1 server: its `
              + `answer to auth began ${describeStart(received.readUInt16BE(0))}, not 00 00`,
            this,
          ));
        }
      };
      handlers.error = (error) => reject(this.#refused(error, sentAt));
      handlers.close = () => reject(this.#refused(null, sentAt));
      for (const [event, handler] of Object.entries(handlers)) socket.on(event, handler);
    });
    const sentAt = performance.now();
    socket.write(encodeAuth(this.token));
    try {
      await this.limit(answered, 'cannot connect to', () => socket.destroy());
    } catch (error) {
      socket.destroy();
      throw error;
    } finally {
      for (const [event, handler] of Object.entries(handlers)) socket.removeListener(event, handler);
    }
  }

  /**
   * @param {(Error & { code?: string }) | null} error
   * @param {number} sentAt `performance.now()` when the auth went out
   */
  #refused(error, sentAt) {
    // A server that refuses a token closes about half a second after the auth; sooner, it did
    // not judge the token: a TLS port (for a plain client), its connection limit, or a 1.0 server.
    const judged = performance.now() - sentAt >= TOKEN_JUDGED_MS;
    const causes = 'be at its connection limit, refuse clients from other hosts, or speak '
      + 'protocol 1.0, which has no auth';
    return this.connectionError(
      judged
        ? `${this.address} closed the connection in answer to auth: it does not take this token `
          + '(or speaks protocol 1.0, which has no auth)'
        : `${this.address}: the server closed the connection at once, without judging the token `
          + `(it may ${this.tls === null ? `speak TLS only, which this client did not; or ${causes}` : causes})`,
      error ? { code: error.code, cause: error } : {},
    );
  }
}

// A pinpriq 1.0 server closes the connection on the opcode of sync, which it does not know.
const SYNC_HINT = '; it had not answered a sync, and a protocol 1.0 server closes the connection '
  + 'on sync';
// And a 1.0 or 1.1 server on a push with options (71).
const OPTIONS_HINT = '; it had not shown it read a push with a delay or a TTL above 65,535 ms, '
  + 'and a server older than protocol 1.2 closes the connection on one';

/**
 * What is known about how a connection went; `watchSocket` keeps it up to date.
 * @typedef {object} ConnectionState
 * @property {boolean} closedByUs we closed it (or are closing it)
 * @property {Error | null} error its first error, or the reason we broke it off
 * @property {boolean} ended the server ended the stream, or we broke the connection off
 * @property {number} [openedAt] `performance.now()` when it was connected
 * @property {number} [lostAt] `performance.now()` when the server's end of stream or an error
 *   came, if it did
 * @property {boolean} [received] whether the server ever sent a byte
 * @property {boolean} [syncUnanswered] the oldest request left when it closed was a sync
 * @property {boolean} [optionsUnproven] a push with options (71) had gone out that the server
 *   was not shown to have read
 */

/**
 * Why a connection ended, as the error to give callers.
 * @param {Endpoint} endpoint
 * @param {ConnectionState} state
 */
function closeError(endpoint, state) {
  const { closedByUs, error, syncUnanswered, optionsUnproven } = state;
  if (closedByUs) return endpoint.connectionError(`connection to ${endpoint.address} is closed`);
  // Ours, and it already says what went wrong and where.
  if (error instanceof PinpriqError) return error;
  const hint = (syncUnanswered ? SYNC_HINT : '') + (optionsUnproven ? OPTIONS_HINT : '');
  if (closedAtOnce(state)) {
    return endpoint.connectionError(
      `connection to ${endpoint.address}: ${CLOSED_AT_ONCE}${hint}`,
      error ? { code: error.code, cause: error } : {},
    );
  }
  if (error) {
    const reason = REASONS[error.code] ?? error.message;
    return endpoint.connectionError(`connection to ${endpoint.address} broke: ${reason}${hint}`, {
      code: error.code, cause: error,
    });
  }
  return endpoint.connectionError(
    `connection to ${endpoint.address} was closed by the server${hint}`,
  );
}

/**
 * Whether the server closed or reset the connection before sending a byte, soon after it was
 * made: what a server beyond its connection limit does.
 * @param {ConnectionState} state
 */
function closedAtOnce({ received, openedAt, lostAt }) {
  return !received && openedAt !== undefined && lostAt !== undefined
    && lostAt - openedAt < CLOSED_AT_ONCE_MS;
}

/**
 * The first two bytes of a reply, from its count, in hex and, when printable, as text: what a
 * server of another kind sent, for the message that says so.
 * @param {number} count
 */
function describeStart(count) {
  const bytes = Buffer.from([count >> 8, count & 0xff]);
  const hex = [...bytes].map((byte) => byte.toString(16).padStart(2, '0')).join(' ');
  const printable = bytes.every((byte) => byte >= 0x20 && byte < 0x7f);
  return printable ? `${hex} (${JSON.stringify(bytes.toString('latin1'))})` : hex;
}

/**
 * Wires a just-connected socket: chunks to `onData`; into `state`, when it was connected,
 * whether any byte came, its first error and the server's end of stream, and when either came
 * (calls fail from the end of stream on, even before the socket is closed).
 * @param {import('node:net').Socket} socket
 * @param {ConnectionState} state
 * @param {(chunk: Buffer) => void} onData
 * @param {() => void} onClose
 * @returns {Promise<void>} resolved once the socket is closed, after `onClose`
 */
function watchSocket(socket, state, onData, onClose) {
  state.openedAt = performance.now();
  state.received = false;
  const lost = () => { state.lostAt ??= performance.now(); };
  socket.on('data', (chunk) => {
    state.received = true;
    onData(chunk);
  });
  socket.on('error', (error) => {
    lost();
    state.error ??= error;
  });
  socket.once('end', () => {
    lost();
    state.ended = true;
  });
  return new Promise((resolve) => socket.once('close', () => {
    onClose();
    resolve();
  }));
}

/**
 * Write one whole frame; resolves once Node has handed it to the operating system.
 * @param {net.Socket} socket
 * @param {Buffer} frame
 * @returns {Promise<void>}
 */
function writeFrame(socket, frame) {
  return new Promise((resolve, reject) => {
    socket.write(frame, (error) => (error ? reject(error) : resolve()));
  });
}

/**
 * A connection to a pinpriq server. Make one with `await PinpriqClient.connect(...)`; any
 * number of callers may share it.
 */
export class PinpriqClient {
  #endpoint;
  #socket;
  /** replies taken from the decoder so far: where `#pending[0]` stands in its count */
  #answered = 0;
  #decoder = new ReplyDecoder({
    leased: (position) => this.#pending[position - this.#answered]?.lease ?? false,
  });
  /**
   * Requests awaiting their replies, oldest first: pops and syncs, and (read with the lease
   * header) reserves and the acks, releases and touches of leases held on this connection.
   * @type {{ resolve: (reply: Packet[] | LeaseMessage) => void, reject: (e: Error) => void,
   *   abandoned: boolean, sync: boolean, lease: boolean, leaseId: number | null }[]}
   */
  #pending = [];
  /** @type {Set<Subscription>} */
  #subscriptions = new Set();
  /** @type {ConnectionState} */
  #state = {
    closedByUs: false, error: null, ended: false, syncUnanswered: false, optionsUnproven: false,
  };
  /** a push with options (71, protocol 1.2) went out, and no reply has shown it was read */
  #optionsUnproven = false;
  /** the first request sent after it, whose reply shows it */
  #optionsProof = null;
  #ended;

  /**
   * Connect to a server.
   * @param {ConnectOptions} [options]
   * @returns {Promise<PinpriqClient>}
   * @throws {PinpriqConnectionError} the server cannot be reached (the message names host:port)
   * @throws {PinpriqTimeoutError} no connection within `timeout`
   */
  static async connect(options = {}) {
    const endpoint = new Endpoint(options);
    return new PinpriqClient(endpoint, await endpoint.open());
  }

  /** @private Use `PinpriqClient.connect`. */
  constructor(endpoint, socket) {
    if (!(endpoint instanceof Endpoint)) {
      throw new TypeError('use PinpriqClient.connect() to make a client');
    }
    this.#endpoint = endpoint;
    this.#socket = socket;
    this.#ended = watchSocket(socket, this.#state, (chunk) => this.#onData(chunk), () => this.#onClose());
  }

  /** The server, as `host:port`. */
  get address() {
    return this.#endpoint.address;
  }

  /** True once the connection is closed or closing; calls then reject. */
  get closed() {
    return this.#state.closedByUs || this.#state.ended;
  }

  /**
   * Queue `payload` under `key`. The server does not answer a push: the promise resolves once
   * the frame has been handed to the operating system, or with `confirm`, once the server has
   * applied it.
   * @param {Data} queue
   * @param {Data} key
   * @param {Data} payload
   * @param {{ ttlMs?: number, prio?: number, delayMs?: number, confirm?: boolean }} [options]
   *   `prio` 1 (the default) is the highest, 255 the lowest, 0 never popped on its own but
   *   leaves with the next popped packet of its key; `ttlMs` 0 (the default) never expires,
   *   else 1..4294967295 ms, counted from when the packet enters its queue; `delayMs`
   *   (0..2592000000, 30 days) keeps it out of its queue that long; `confirm: true` sends a
   *   sync with the push and resolves when its answer comes (protocol 1.1). A delay or a TTL
   *   above 65,535 ms makes the push a 71, which needs a protocol 1.2 server; any other push
   *   is the 1.0 frame every server takes
   * @returns {Promise<void>}
   */
  async push(queue, key, payload, options = {}) {
    const frame = encodePush(queue, key, payload, options);
    const confirm = options.confirm ?? false;
    if (typeof confirm !== 'boolean') {
      throw new TypeError(`confirm must be true or false, not ${typeof confirm}`);
    }
    this.#checkOpen();
    if (frame[0] === OPCODE.PUSH_OPTIONS) {
      // Until a request sent after it is answered, a close may be an older server's answer.
      this.#optionsUnproven = true;
      this.#optionsProof = null;
    }
    if (confirm) {
      // One write: the sync's answer comes once the push before it is applied.
      await this.#request(Buffer.concat([frame, encodeSync()]), 'push to', { sync: true });
      return;
    }
    try {
      await this.#endpoint.limit(writeFrame(this.#socket, frame), 'push to');
    } catch (error) {
      throw this.#wrap(error);
    }
  }

  /**
   * Take the best packet of `queue` together with every other packet of its key: the selected
   * one first, the rest oldest first. Empty when nothing can be selected.
   * @param {Data} queue
   * @returns {Promise<Packet[]>}
   */
  async pop(queue) {
    const frame = encodePop(queue);
    this.#checkOpen();
    return this.#request(frame, 'pop from', {});
  }

  /**
   * Take what `pop` would, on a lease (protocol 1.1): the packets come back to their queue
   * unless acked within `leaseMs`. Resolves to a `Lease`, empty if nothing could be taken. The
   * lease belongs to this connection: if it closes, the packets go back.
   * @param {Data} queue
   * @param {{ leaseMs?: number }} [options] 0..86400000 ms; 0 (the default): the server's
   *   default lease time (30 s unless it was started otherwise)
   * @returns {Promise<Lease>}
   */
  async reserve(queue, { leaseMs = 0 } = {}) {
    const frame = encodeReserve(queue, { leaseMs });
    this.#checkOpen();
    const message = await this.#request(frame, 'reserve from', { lease: true });
    return new Lease(message, (answer, leaseId) => this.#answer(answer, leaseId));
  }

  /** Sends an ack, release or touch of a lease held here; whether the lease was live. */
  async #answer(frame, leaseId) {
    this.#checkOpen();
    const message = await this.#request(frame, 'lease at', { lease: true, leaseId });
    return message.attempt === 1;
  }

  /**
   * Resolves once the server has applied every frame this client sent before it: the way to
   * know that earlier pushes are in their queues (protocol 1.1, sync). Rejects with
   * `PinpriqProtocolError`, and closes the client, if the answer is not a pinpriq server's.
   * @returns {Promise<void>}
   */
  async sync() {
    this.#checkOpen();
    await this.#request(encodeSync(), 'sync with', { sync: true });
  }

  /**
   * Receive packets from `queues` as they arrive, on a connection of its own.
   * @param {Data | Data[]} queues one queue or several; the best packet across them comes first
   * @param {{ prefetch?: number, limit?: number, leaseMs?: number }} [options] `prefetch`
   *   (1..65535, default 1): deliveries the server may send ahead of the one you are handling;
   *   `limit` (an integer >= 1, default none): the iteration ends after that many deliveries,
   *   and no more are ever asked of the server; `leaseMs` (protocol 1.1; 0..86400000, 0 for the
   *   server's default): every delivery is a `Lease` instead, and a `LeasedSubscription` is
   *   returned
   * @returns {Promise<Subscription>}
   */
  async subscribe(queues, { prefetch = 1, limit, leaseMs } = {}) {
    const list = Array.isArray(queues) ? queues : [queues];
    if (list.length === 0) throw new RangeError('queues must name at least one queue');
    checkInteger('prefetch', prefetch, 1, MAX_PREFETCH);
    if (limit !== undefined) checkInteger('limit', limit, 1, Infinity);
    const leased = leaseMs !== undefined;
    const encode = leased
      ? (queue) => encodeLeasedSubscribe(queue, { leaseMs })
      : encodeSubscribe;
    // As the Python client does: never a credit for a delivery beyond the limit.
    const credits = Math.min(prefetch, limit ?? Infinity);
    const opening = Buffer.concat([...list.map(encode), encodeReady(credits)]);
    this.#checkOpen();
    const socket = await this.#endpoint.open();
    const openedAt = performance.now();
    if (this.closed) { // closed while we were connecting: don't leave this one behind
      socket.destroy();
      throw closeError(this.#endpoint, this.#state);
    }
    const subscription = new (leased ? LeasedSubscription : Subscription)(
      this.#endpoint, socket, () => this.#subscriptions.delete(subscription),
      { granted: credits, limit: limit ?? Infinity },
    );
    this.#subscriptions.add(subscription);
    try {
      await this.#endpoint.limit(writeFrame(socket, opening), 'subscribe at');
    } catch (error) {
      // The opening is the first thing on the connection: a failure to write it is a close
      // before the server sent anything.
      const failure = error instanceof PinpriqTimeoutError
        ? error
        : closeError(this.#endpoint, {
          closedByUs: false, error, ended: true, received: false, openedAt,
          lostAt: performance.now(),
        });
      await subscription.close();
      throw failure;
    }
    return subscription;
  }

  /**
   * Run `handler(job)` for each job of `queues`, taken on a lease, until `limit` jobs (for
   * ever without one): the worker loop of at-least-once delivery. Jobs come from a leased
   * subscription, on a connection of its own. While the handler runs the lease is touched every
   * `leaseMs / 2`, so a slow job is not handed to another worker. When the handler resolves, a
   * sync on this client confirms whatever it pushed with this client (follow-up jobs), and then
   * the job is acked. When it rejects, `onError(error, job)` is called (by default it writes a
   * line to stderr) and the job is released, to come back after `retryDelayMs`. Push follow-ups
   * with this client, never on a lease's connection: on a full server a push waits for room,
   * and acks and touches behind it would wait too.
   * @param {Data | Data[]} queues
   * @param {(job: Lease) => Promise<unknown> | unknown} handler
   * @param {{ leaseMs?: number, prefetch?: number, limit?: number, retryDelayMs?: number,
   *   onError?: (error: unknown, job: Lease) => void }} [options]
   * @returns {Promise<void>} resolves after `limit` jobs
   */
  async work(queues, handler, {
    leaseMs = DEFAULT_WORK_LEASE_MS, prefetch = 1, limit, retryDelayMs = 0,
    onError = reportFailure,
  } = {}) {
    if (typeof handler !== 'function') throw new TypeError('handler must be a function');
    checkInteger('leaseMs', leaseMs, 1, MAX_LEASE_MS);
    checkInteger('retryDelayMs', retryDelayMs, 0, MAX_LEASE_MS);
    const jobs = await this.subscribe(queues, { prefetch, limit, leaseMs });
    try {
      for await (const job of jobs) {
        await this.#workOn(job, handler, { leaseMs, retryDelayMs, onError });
      }
    } finally {
      await jobs.close();
    }
  }

  async #workOn(job, handler, { leaseMs, retryDelayMs, onError }) {
    const keeper = setInterval(() => {
      job.touch({ leaseMs }).then((live) => {
        if (!live) clearInterval(keeper); // gone: the job may run again elsewhere
      }, () => clearInterval(keeper));
    }, leaseMs / 2);
    let failure;
    let failed = false;
    try {
      await handler(job);
    } catch (error) {
      failure = error;
      failed = true;
    } finally {
      clearInterval(keeper);
    }
    if (job.settled) return; // the handler acked or released it itself
    if (!failed) {
      await this.sync();
      await job.ack();
      return;
    }
    onError(failure, job);
    await job.release({ delayMs: retryDelayMs });
  }

  /**
   * Close the connection gracefully: frames already written are sent, pops already sent still
   * get their replies, then the connection closes (forced after `timeout`). Subscriptions made
   * by this client are closed too. New calls reject.
   * @returns {Promise<void>}
   */
  async close() {
    if (!this.closed) {
      this.#state.closedByUs = true;
      this.#socket.end();
      const timer = this.#endpoint.timeout > 0 && this.#endpoint.timeout <= MAX_TIMER_MS
        ? setTimeout(() => this.#socket.destroy(), this.#endpoint.timeout)
        : undefined;
      this.#ended.finally(() => clearTimeout(timer));
    }
    await Promise.all([this.#ended, ...[...this.#subscriptions].map((s) => s.close())]);
  }

  /** Close at once: waiting pops reject, subscriptions end. */
  destroy() {
    this.#state.closedByUs = true;
    this.#socket.destroy();
    for (const subscription of this.#subscriptions) subscription.close();
  }

  /**
   * Writes `frame`, whose last frame is a pop, a sync or a lease frame, and waits for that
   * one's reply.
   * @param {Buffer} frame
   * @param {string} what the start of a timeout's message, such as `pop from`
   * @param {{ sync?: boolean, lease?: boolean, leaseId?: number }} kind `sync`: the reply
   *   must be a sync's `00 00`; `lease`: it has the lease header; `leaseId`: it answers an
   *   ack, release or touch of that lease
   * @returns {Promise<Packet[] | LeaseMessage>}
   */
  #request(frame, what, { sync = false, lease = false, leaseId = null }) {
    const waiter = { resolve: null, reject: null, abandoned: false, sync, lease, leaseId };
    const reply = new Promise((resolve, reject) => Object.assign(waiter, { resolve, reject }));
    // Same synchronous step as the write: the FIFO order is the order frames go out.
    this.#pending.push(waiter);
    if (this.#optionsUnproven) this.#optionsProof ??= waiter;
    this.#socket.write(frame);
    // A timed-out request keeps its place: its reply arrives later and is dropped (for a pop,
    // whatever it took is lost: at most once).
    return this.#endpoint.limit(reply, what, () => { waiter.abandoned = true; });
  }

  #onData(chunk) {
    for (const reply of this.#decoder.feed(chunk)) {
      const waiter = this.#pending[0];
      if (waiter === undefined) {
        this.#state.error ??= new Error('the server sent a reply nobody asked for');
        this.#socket.destroy();
        return;
      }
      if (waiter.sync && reply.length > 0) {
        this.#notPinpriq(reply.length);
        return;
      }
      if (waiter.leaseId !== null && !answers(reply, waiter.leaseId)) {
        this.#outOfStep(reply, waiter.leaseId);
        return;
      }
      this.#pending.shift();
      this.#answered += 1;
      if (waiter === this.#optionsProof) { // replies come in order: the server read the 71
        this.#optionsUnproven = false;
        this.#optionsProof = null;
      }
      if (!waiter.abandoned) waiter.resolve(reply);
    }
    // A sync's answer is 00 00: judge it by its first two bytes, because another kind of
    // server's answer (an error line) reads as a huge count whose packets never come.
    const count = this.#decoder.incomingCount;
    if (count !== null && this.#pending[0]?.sync) this.#notPinpriq(count);
  }

  /**
   * The server answered a sync with a reply of `count` packets: it is no pinpriq 1.1 server.
   * Closes the client as `destroy()` does, keeping the error for every call.
   * @param {number} count
   */
  #notPinpriq(count) {
    this.#state.error ??= new PinpriqProtocolError(
      `the server at ${this.address} did not answer like a pinpriq 1.1 server: its answer to `
        + `a sync began ${describeStart(count)}, not 00 00`,
      this.#endpoint,
    );
    this.#state.ended = true; // calls fail from now on, before the socket has closed
    this.#socket.destroy();
    for (const subscription of this.#subscriptions) subscription.close();
  }

  /** An answer about another lease: the connection is out of step, and is closed. */
  #outOfStep(message, leaseId) {
    this.#state.error ??= outOfStepError(this.#endpoint, message, leaseId);
    this.#state.ended = true;
    this.#socket.destroy();
  }

  #onClose() {
    this.#state.ended = true;
    // The oldest request left unanswered was a sync: the close may be a 1.0 server's answer.
    this.#state.syncUnanswered = this.#pending[0]?.sync ?? false;
    this.#state.optionsUnproven = this.#optionsUnproven;
    const error = closeError(this.#endpoint, this.#state);
    for (const waiter of this.#pending.splice(0)) waiter.reject(error);
  }

  #checkOpen() {
    if (this.closed) throw closeError(this.#endpoint, this.#state);
  }

  /** A failed write as the error to give the caller. */
  #wrap(error) {
    if (error instanceof PinpriqTimeoutError) return error;
    this.#state.error ??= error;
    return closeError(this.#endpoint, this.#state);
  }
}

if (Symbol.asyncDispose) {
  PinpriqClient.prototype[Symbol.asyncDispose] = function dispose() { return this.close(); };
}

/** The default `onError` of `work`: one line on stderr. */
function reportFailure(error, job) {
  const key = job.packets[0]?.key.toString() ?? '';
  console.error(`pinpriq: job ${JSON.stringify(key)} (attempt ${job.attempt}) failed, released: `
    + `${error instanceof Error ? error.message : String(error)}`);
}

/** Whether `message` is the answer to an ack, release or touch of lease `leaseId`. */
function answers(message, leaseId) {
  return message.leaseId === leaseId && message.packets.length === 0;
}

/** @param {Endpoint} endpoint @param {LeaseMessage} message @param {number} leaseId */
function outOfStepError(endpoint, message, leaseId) {
  return new PinpriqProtocolError(
    `${endpoint.address} answered a request about lease ${leaseId} with a message about lease `
      + `${message.leaseId} (${message.packets.length} packets): out of step`,
    endpoint,
  );
}

/**
 * A group of packets on a lease (protocol 1.1), from `PinpriqClient.reserve` or a leased
 * subscription. `packets` is the group as a pop gives it; `attempt` is 1 the first time it is
 * leased and counts up each time it comes back (saturating at 255); `leaseId` names the lease
 * on its connection. A reserve that found nothing gives an empty lease (`empty`, no packets,
 * id 0) whose ack, release and touch send nothing and resolve to false.
 *
 * Acks, releases and touches go on the connection that holds the lease, and resolve to whether
 * it was still live: false means its deadline had passed (or it was ended already), so its
 * packets went back and may be, or have been, delivered again.
 */
export class Lease {
  #answer;
  #settled = false;

  /**
   * @private Made by `reserve` and leased subscriptions.
   * @param {LeaseMessage} message
   * @param {(frame: Buffer, leaseId: number) => Promise<boolean>} answer
   */
  constructor({ leaseId, attempt, packets }, answer) {
    this.leaseId = leaseId;
    this.attempt = attempt;
    this.packets = packets;
    this.#answer = answer;
  }

  /** True when nothing was taken. */
  get empty() {
    return this.packets.length === 0;
  }

  /** True once `ack` or `release` was called. */
  get settled() {
    return this.#settled;
  }

  /** The job is done: its packets are gone for good. @returns {Promise<boolean>} */
  async ack() {
    if (this.empty) return false;
    this.#settled = true;
    return this.#answer(encodeAck(this.leaseId), this.leaseId);
  }

  /**
   * Give the job up: its packets go back to their queue after `delayMs` (0, the default: at
   * once), with their priority and their place in push order.
   * @param {{ delayMs?: number }} [options]
   * @returns {Promise<boolean>}
   */
  async release({ delayMs = 0 } = {}) {
    if (this.empty) return false;
    const frame = encodeRelease(this.leaseId, { delayMs });
    this.#settled = true;
    return this.#answer(frame, this.leaseId);
  }

  /**
   * The lease now ends `leaseMs` from now (0, the default: the server's default lease time).
   * @param {{ leaseMs?: number }} [options]
   * @returns {Promise<boolean>}
   */
  async touch({ leaseMs = 0 } = {}) {
    if (this.empty) return false;
    return this.#answer(encodeTouch(this.leaseId, { leaseMs }), this.leaseId);
  }
}

/**
 * The deliveries of one subscription, an async iterator of `Packet[]` (each like a pop's
 * reply: the selected packet, then the rest of its key group). Made by
 * `PinpriqClient.subscribe`. Use `for await (const packets of subscription)`; leaving the loop
 * (or calling `close()`) closes the subscription's connection.
 *
 * @implements {AsyncIterableIterator<Packet[]>}
 */
export class Subscription {
  #endpoint;
  #socket;
  #decoder;
  /** whether deliveries are leases (a `LeasedSubscription`) */
  #leased;
  /**
   * Acks, releases and touches sent on a leased subscription, awaiting their answers.
   * @type {{ resolve: (m: LeaseMessage) => void, reject: (e: Error) => void, leaseId: number }[]}
   */
  #answers = [];
  /** @type {(Packet[] | Lease)[]} deliveries received and not yet taken */
  #buffered = [];
  /** @type {{ resolve: (r: IteratorResult<Packet[]>) => void, reject: (e: Error) => void }[]} */
  #waiting = [];
  /** @type {ConnectionState} */
  #state = { closedByUs: false, error: null, ended: false };
  #errorReported = false;
  #ended;
  /** deliveries handed out whose credits go back when the consumer asks for the next one */
  #owed = 0;
  /** credits sent to the server so far */
  #granted;
  /** deliveries to hand out in all (`Infinity`: no limit) */
  #limit;
  /** deliveries handed out so far */
  #taken = 0;

  /**
   * @private Use `PinpriqClient.subscribe`.
   * @param {Endpoint} endpoint
   * @param {net.Socket} socket
   * @param {() => void} onClose
   * @param {{ granted: number, limit: number, leased?: boolean }} credits the credits the
   *   opening granted, and the most deliveries to hand out; `leased`: the deliveries are leases
   */
  constructor(endpoint, socket, onClose, { granted, limit, leased = false }) {
    if (!(endpoint instanceof Endpoint)) {
      throw new TypeError('use PinpriqClient.subscribe() to make a subscription');
    }
    this.#endpoint = endpoint;
    this.#socket = socket;
    this.#leased = leased;
    // A leased connection gets nothing but lease messages (decision 18).
    this.#decoder = new ReplyDecoder({ leased: () => leased });
    this.#granted = granted;
    this.#limit = limit;
    this.#ended = watchSocket(socket, this.#state, (chunk) => this.#onData(chunk), () => {
      this.#onClose();
      onClose();
    });
  }

  /** The server, as `host:port`. */
  get address() {
    return this.#endpoint.address;
  }

  /** True once the subscription's connection is closed or closing. */
  get closed() {
    return this.#state.closedByUs || this.#state.ended;
  }

  /** Deliveries received from the server and not yet taken (at most `prefetch`). */
  get buffered() {
    return this.#buffered.length;
  }

  [Symbol.asyncIterator]() {
    return this;
  }

  /**
   * The next delivery. Asking for it returns the credit of the delivery taken before, so
   * `prefetch` counts the delivery your code is handling (as the Python client does). After
   * `limit` deliveries, `done`. Once the connection ends, the deliveries already received are
   * still returned, then the error that ended it (unless you closed it), then `done`.
   * @returns {Promise<IteratorResult<Packet[], undefined>>}
   */
  next() {
    this.#returnCredits();
    if (this.#taken === this.#limit) {
      // A leased subscription stays open until here: the last lease is acked on it.
      const closed = this.#leased ? this.close() : Promise.resolve();
      return closed.then(() => ({ value: undefined, done: true }));
    }
    if (this.#buffered.length > 0) return Promise.resolve(this.#take(this.#buffered.shift()));
    if (this.#state.ended) {
      if (!this.#state.closedByUs && !this.#errorReported) {
        this.#errorReported = true;
        return Promise.reject(this.error());
      }
      return Promise.resolve({ value: undefined, done: true });
    }
    return new Promise((resolve, reject) => this.#waiting.push({ resolve, reject }));
  }

  /** Called by `for await` when the loop exits early: closes the subscription. */
  async return() {
    await this.close();
    return { value: undefined, done: true };
  }

  /**
   * Close the subscription's connection. Deliveries received and not yet taken are lost
   * (delivery is at most once), or, on a leased subscription, go back to their queues with
   * every lease not yet acked; a waiting `next()` resolves as done.
   * @returns {Promise<void>}
   */
  async close() {
    if (!this.#state.ended) {
      this.#state.closedByUs = true;
      this.#buffered.length = 0;
      this.#socket.destroy();
    }
    await this.#ended;
  }

  /** Why the connection ended, as the error `next()` reports. */
  error() {
    return closeError(this.#endpoint, this.#state);
  }

  /**
   * Sends back the credits of the deliveries the consumer has finished with, but only as many
   * as the deliveries still to come under `limit` need.
   */
  #returnCredits() {
    const credits = Math.min(this.#owed, this.#limit - this.#granted);
    this.#owed = 0;
    if (credits > 0 && !this.#state.ended) {
      this.#socket.write(encodeReady(credits));
      this.#granted += credits;
    }
  }

  /** Hands a delivery to the consumer; its credit goes back with the next `next()`. */
  #take(delivery) {
    this.#owed += 1;
    this.#taken += 1;
    // The last delivery of the limit: nothing more can come, so the connection can go now,
    // even if the consumer never asks for the next one; unless the delivery is a lease, which
    // is acked on this connection.
    if (this.#taken === this.#limit && !this.#leased) this.close();
    return { value: delivery, done: false };
  }

  /**
   * Sends an ack, release or touch of a lease delivered here; whether the lease was live.
   * @param {Buffer} frame
   * @param {number} leaseId
   * @returns {Promise<boolean>}
   */
  async #answer(frame, leaseId) {
    if (this.#state.ended) throw this.error();
    const answer = new Promise((resolve, reject) => {
      this.#answers.push({ resolve, reject, leaseId });
    });
    this.#socket.write(frame);
    const message = await this.#endpoint.limit(answer, 'lease at');
    return message.attempt === 1;
  }

  /** A lease message: an answer (count 0) for the oldest ack, release or touch, or a delivery. */
  #onLeaseMessage(message) {
    if (message.packets.length > 0) {
      return new Lease(message, (frame, leaseId) => this.#answer(frame, leaseId));
    }
    const waiter = this.#answers.shift();
    if (waiter === undefined || !answers(message, waiter.leaseId)) {
      this.#state.error ??= waiter === undefined
        ? new Error(`the server sent an answer about lease ${message.leaseId} nobody asked for`)
        : outOfStepError(this.#endpoint, message, waiter.leaseId);
      this.#socket.destroy();
      return null;
    }
    waiter.resolve(message);
    return undefined;
  }

  #onData(chunk) {
    for (const message of this.#decoder.feed(chunk)) {
      let delivery = message;
      if (this.#leased) {
        delivery = this.#onLeaseMessage(message);
        if (delivery === null) return; // out of step: the connection is closing
        if (delivery === undefined) continue; // an answer, not a delivery
      } else if (delivery.length === 0) {
        // Only a pop is answered 00 00, and this connection never pops.
        this.#state.error ??= new Error('the server sent an empty delivery');
        this.#socket.destroy();
        return;
      }
      const waiter = this.#waiting.shift();
      if (waiter) waiter.resolve(this.#take(delivery));
      else this.#buffered.push(delivery);
    }
  }

  #onClose() {
    this.#state.ended = true;
    const unanswered = this.#answers.splice(0);
    if (unanswered.length > 0) {
      const error = this.error();
      for (const waiter of unanswered) waiter.reject(error);
    }
    const waiting = this.#waiting.splice(0);
    if (waiting.length === 0) return;
    if (this.#state.closedByUs) {
      for (const waiter of waiting) waiter.resolve({ value: undefined, done: true });
      return;
    }
    this.#errorReported = true;
    const error = this.error();
    waiting[0].reject(error);
    for (const waiter of waiting.slice(1)) waiter.resolve({ value: undefined, done: true });
  }
}

if (Symbol.asyncDispose) {
  Subscription.prototype[Symbol.asyncDispose] = function dispose() { return this.close(); };
}

/**
 * The deliveries of a leased subscription (protocol 1.1): an async iterator of `Lease`, made
 * by `PinpriqClient.subscribe(queues, { leaseMs })`. Ack each lease when its job is done (or
 * release it); leases not acked when the subscription closes go back to their queues. Acks
 * grant no credit: a credit goes back when you ask for the next delivery, as for any
 * subscription.
 */
export class LeasedSubscription extends Subscription {
  /** @private Use `PinpriqClient.subscribe(queues, { leaseMs })`. */
  constructor(endpoint, socket, onClose, credits) {
    super(endpoint, socket, onClose, { ...credits, leased: true });
  }
}
