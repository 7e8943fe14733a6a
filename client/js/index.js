// pinpriq: a dependency-free client for the pinpriq priority-queue server (protocol 1.0, and
// the sync and auth frames of 1.1).
export {
  DEFAULT_HOST, DEFAULT_PORT, DEFAULT_TIMEOUT, MAX_PREFETCH,
  PinpriqClient, PinpriqConnectionError, PinpriqError, PinpriqProtocolError, PinpriqTimeoutError,
  Subscription,
} from './src/client.js';
export {
  MAX_FIELD_BYTES, MAX_PRIO, MAX_TTL_MS, OPCODE, ReplyDecoder,
  encodeAuth, encodePop, encodePush, encodeReady, encodeSubscribe, encodeSync, encodeUnsubscribe,
} from './src/wire.js';
