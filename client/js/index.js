// pinpriq: a dependency-free client for the pinpriq priority-queue server (protocol 1.0, the
// sync, auth and lease frames of 1.1, and 1.2's delayed pushes and long TTLs).
export {
  DEFAULT_HOST, DEFAULT_PORT, DEFAULT_TIMEOUT, MAX_PREFETCH,
  DEFAULT_WORK_LEASE_MS, Lease, LeasedSubscription,
  PinpriqClient, PinpriqConnectionError, PinpriqError, PinpriqProtocolError, PinpriqTimeoutError,
  Subscription,
} from './src/client.js';
export {
  LEASE_HEADER_BYTES, MAX_DELAY_MS, MAX_FIELD_BYTES, MAX_LEASE_MS, MAX_PRIO, MAX_TTL_MS,
  MAX_TTL_MS_1_0, OPCODE, ReplyDecoder,
  encodeAck, encodeAuth, encodeLeasedSubscribe, encodePop, encodePush, encodeReady,
  encodeRelease, encodeReserve, encodeSubscribe, encodeSync, encodeTouch, encodeUnsubscribe,
} from './src/wire.js';
