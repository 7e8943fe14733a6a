// pinpriq: a dependency-free client for the pinpriq priority-queue server (protocol 1.0, and
// the sync, auth and lease frames of 1.1).
export {
  DEFAULT_HOST, DEFAULT_PORT, DEFAULT_TIMEOUT, MAX_PREFETCH,
  DEFAULT_WORK_LEASE_MS, Lease, LeasedSubscription,
  PinpriqClient, PinpriqConnectionError, PinpriqError, PinpriqProtocolError, PinpriqTimeoutError,
  Subscription,
} from './src/client.js';
export {
  LEASE_HEADER_BYTES, MAX_FIELD_BYTES, MAX_LEASE_MS, MAX_PRIO, MAX_TTL_MS, OPCODE, ReplyDecoder,
  encodeAck, encodeAuth, encodeLeasedSubscribe, encodePop, encodePush, encodeReady,
  encodeRelease, encodeReserve, encodeSubscribe, encodeSync, encodeTouch, encodeUnsubscribe,
} from './src/wire.js';
