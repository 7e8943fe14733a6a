"""The server-side scripts of the Redis store: each push, pop, sweep and purge is one of these,
so each is atomic in Redis whatever other front ends do at the same moment.

The keys of one queue, layout 5 (layout 6 keeps them: it changed the functions, and what a
plain pop returns; every key carries the queue's hash tag, so all of them, and those of its
dead-letter queues, live in one Cluster slot; ``keys.py`` builds the names). A packet's *field*
is its key with the key's length before it (``key length u16 | key``), its *seq* its sequence
number in 16 digits, its *ref* ``seq | field``:

* ``:d`` hash, the queue's packets and their key index in one: a key with one packet has its
  field -> the packet's record (``seq | prio u8 | deadline (ms, double) | payload``); a key
  with more has its field -> ``#n`` (a *marker*: n packets) and each packet under its seq ->
  its record. The field ``q`` (no field or seq has one byte) holds the queue's last sequence
  number, then how many markers the hash holds (none: no digits), so the packets are its
  length less one less the markers. A packet is live exactly while this hash holds it.
* ``:s`` sorted set of the selectable packets (prio 1..255): score ``-prio``, member the ref,
  so the *last* member is the lowest prio and, among equal prios, the newest (equal scores
  order by member, and refs start with fixed-width digits); a pop reads the field from it.
* ``:g`` sorted set of the packets of keys with more than one: member ``field | seq``, score 0,
  so one lexicographic range is a key group in push order. A lone key has no entry.
* ``:x`` sorted set of the refs of packets with a TTL, by deadline (ms on Redis's clock).
* ``:w`` exists while some front end has subscribers waiting on the queue: a push of a
  selectable packet then publishes the queue's channel (``ARGV``), and only then.

Sequence numbers are Redis's ``TIME`` in microseconds, bumped past the queue's last one, so
"newest" is push order within a queue and, across queues of one Redis, the order of Redis's
clock. They are below 2^53, so Lua's doubles hold them exactly; ``%016.0f`` writes them.
Deadline 0 means "never" (TTL 0).
"""

from __future__ import annotations

__all__ = [
    "KEYS_SINCE",
    "KEY_AT",
    "LAYOUT",
    "LEASE_OP",
    "LEASE_SWEEP",
    "LIBRARY",
    "LIBRARY_NAME",
    "META",
    "MOVE",
    "MOVES_KEPT",
    "MOVE_IN",
    "MOVE_OUT",
    "PAYLOAD_AT",
    "PEEK",
    "POP",
    "PURGE",
    "PUSH",
    "PUSH_DELAYED",
    "RANK",
    "RESERVE",
    "RESTORE",
    "SWEEP",
    "function_name",
    "packets_held",
]


# Shared helpers, defined once when Redis loads the library. The hot loops (a push batch, a
# large key group) avoid parsing what they already know: a call into Redis or a struct call
# per packet is what a function's time goes to.
_HELPERS = r"""
-- The double 0.0 (no struct or string library while Redis loads a library: a literal).
local NEVER = '\0\0\0\0\0\0\0\0'
-- The field of ``:d`` holding the last sequence number and the marker count.
local META = 'q'
-- Redis's clock in ms, TIME's reply, and the clock in microseconds (``clock_us``'s).
local function now_ms()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), t, s * 1000000 + us
end
-- Redis's clock in ms with its microseconds: due times (decision 21) are exact to them.
local function now_precise()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000, t
end
-- Redis's clock in microseconds, as TIME (``t``) gives it: where new sequence numbers start.
local function clock_us(t) return tonumber(t[1]) * 1000000 + tonumber(t[2]) end
local function digits(n) return string.format('%016.0f', n) end
-- Tables made at a library's first call (no string library while Redis loads one) and kept:
-- CHAR[b] the byte b as a string, LAST3[i] i in three digits, LEN2[n] n as a u16, PRIO[s]
-- the prio written ``s`` as a number, SCORE[p] prio p's score in ``:s`` as a string. A string
-- function or a number conversion a packet (a ``string.format``, a ``tonumber``, a number
-- argument to ``redis.call``) costs more than a table lookup.
local CHAR, LAST3, LEN2, PRIO, SCORE
local function tables()
  if CHAR then return end
  CHAR, LAST3, LEN2, PRIO, SCORE = {}, {}, {}, {}, {}
  for i = 0, 255 do
    CHAR[i] = string.char(i)
    PRIO[tostring(i)] = i
    SCORE[i] = tostring(-i)
  end
  for i = 0, 999 do LAST3[i] = string.format('%03d', i) end
end
-- The digits of ``seq``, the next of consecutive sequence numbers: ``head``, their first 13
-- digits as the previous call returned them (nil for the first), is formatted again only
-- once a thousand numbers. Returns the digits and the head.
local function seq_digits(seq, head)
  local low = seq % 1000
  if low == 0 or not head then head = string.sub(digits(seq), 1, 13) end
  return head .. LAST3[low], head
end
-- A key's field: its u16 length, then the key. No field is a prefix of another's, so a key
-- group is one lexicographic range of ``:g``, and none has one byte (``META``) or is a seq
-- (16 bytes would be a key of 14, whose field starts with a zero byte, never a digit).
local function field_of(key)
  local n = #key
  local length = LEN2[n]
  if not length then
    length = CHAR[math.floor(n / 256)] .. CHAR[n % 256]
    LEN2[n] = length
  end
  return length .. key
end
local function packed_deadline(deadline)
  if deadline > 0 then return struct.pack('>d', deadline) end
  return NEVER
end
local function deadline_of(rec) return struct.unpack('>d', string.sub(rec, 18, 25)) end
-- A delayed packet's record (``:y``, decision 21): ``prio u8 | deadline f64 | field | payload``
-- (its seq is its field in ``:y``).
local function key_length(rec)
  local high, low = string.byte(rec, 10, 11)
  return high * 256 + low
end
local function delayed_record(prio, deadline, field, payload)
  return CHAR[prio] .. packed_deadline(deadline) .. field .. payload
end
-- One command with many arguments, in slices that stay within Lua's stack.
local function bulk(command, key, args)
  for i = 1, #args, 1000 do
    redis.call(command, key, unpack(args, i, math.min(i + 999, #args)))
  end
end
local function hmget(hash, fields)
  if #fields <= 1000 then return redis.call('HMGET', hash, unpack(fields)) end
  local out = {}
  for i = 1, #fields, 1000 do
    local last = math.min(i + 999, #fields)
    local part = redis.call('HMGET', hash, unpack(fields, i, last))
    for j = i, last do out[j] = part[j - i + 1] end
  end
  return out
end
-- A field's value is a marker (its key has a group: ``#n``) or a record (its key's one
-- packet), which is longer than any marker (its seq, prio and deadline alone are 25 bytes):
-- a length is a VM operation, a ``string.byte`` a C call.
local function grouped(v) return v and #v < 25 end
local function meta_of(v)
  if not v then return 0, 0 end
  return tonumber(string.sub(v, 1, 16)), tonumber(string.sub(v, 17)) or 0
end
-- The marker count alone (no 16-digit number parsed: ``tonumber`` is a ``strtod``).
local function markers_of(v)
  if not v or #v == 16 then return 0 end
  return tonumber(string.sub(v, 17))
end
-- The meta field's value: ``last``, the last seq's digits (as written: no number formatted
-- again), and the marker count.
local function meta_value(last, markers)
  if markers == 0 then return last end
  return last .. markers
end
-- Read into ``state`` (field -> value, false for none) the values of ``fields`` of the hash
-- ``d`` it does not hold yet, and the meta field: one HMGET.
-- (Here and in the other loops run once a packet, numeric ``for`` and counts: ``ipairs``
-- calls a C function an element, ``#t`` searches the table.)
local function read_state(d, fields, state)
  local missing, n = {}, 0
  if state[META] == nil then
    state[META] = false
    missing[1], n = META, 1
  end
  for i = 1, #fields do
    local field = fields[i]
    if state[field] == nil then
      state[field] = false
      n = n + 1
      missing[n] = field
    end
  end
  if n > 0 then
    local values = hmget(d, missing)
    for j = 1, n do
      local v = values[j]
      if v then state[missing[j]] = v end
    end
  end
  return state
end
-- How many packets the queue whose hash is ``d`` holds (``state``: as ``read_state``).
local function held_count(d, state)
  local n = redis.call('HLEN', d)
  if n <= 1 then return 0 end
  if state[META] == nil then state[META] = redis.call('HGET', d, META) or false end
  return n - 1 - markers_of(state[META])
end
-- Filing packets that enter a queue (pushed, promoted, moved in, put back): ``filing()``
-- gathers them, ``file_packet`` adds one (its field, seq, prio, TTL deadline, payload),
-- ``filed`` writes them into the queue whose ``:d`` ``:s`` ``:g`` ``:x`` are given: under the
-- seqs they carry or, given ``clock`` (Redis's TIME in us), under new ones, the first the
-- clock's or one past the queue's last, whichever is later. One HMGET (the meta field and
-- each key's field) and one write a structure. Returns whether a selectable packet entered
-- (waiting front ends are then owed a message) and the queue's marker count.
local function filing()
  return {n = 0, fields = {}, seqs = {}, prios = {}, deadlines = {}, payloads = {}}
end
local function file_packet(f, field, seq, prio, deadline, payload)
  local n = f.n + 1
  f.n = n
  f.fields[n], f.seqs[n], f.prios[n], f.deadlines[n], f.payloads[n] =
    field, seq, prio, deadline, payload
end
-- A queued packet's record is ``seq | prio u8 | deadline f64 | payload``. (The loop below
-- runs once a packet entering: it keeps its own counts rather than taking tables' lengths,
-- and builds each string in one concatenation.)
local function filed(f, d, s, g, x, clock)
  local n = f.n
  if n == 0 then return false, 0 end
  local fields, seqs, prios = f.fields, f.seqs, f.prios
  local deadlines, payloads = f.deadlines, f.payloads
  local state = read_state(d, fields, {})
  local markers = markers_of(state[META])
  local last_digits = state[META] and string.sub(state[META], 1, 16)
  -- New seqs start at the clock's unless it has not passed the last one (digits of one
  -- width compare as their numbers do: a 16-digit ``tonumber`` is a ``strtod``, so the last
  -- seq is parsed only when needed).
  local last, seq, head = 0, clock, nil
  if clock then
    local first = digits(clock)
    if last_digits and first <= last_digits then
      seq = tonumber(last_digits) + 1
    else
      head = string.sub(first, 1, 13)
    end
  elseif last_digits then
    last = tonumber(last_digits)
  end
  -- The HSET's arguments (a field given twice takes its later value: so a key's packets
  -- after its first in the call give its field again), the group index's, the selection's,
  -- the TTLs'.
  local data, members, levels, timed = {}, {}, {}, {}
  local nd, nm, nl, nt = 0, 0, 0, 0
  for i = 1, n do
    local field, prio, deadline = fields[i], prios[i], deadlines[i]
    local sq
    if clock then
      local low = seq % 1000
      if low == 0 or not head then head = string.sub(digits(seq), 1, 13) end
      sq = head .. LAST3[low]
      seq = seq + 1
      last_digits = sq
    else
      sq = seqs[i]
      if tonumber(sq) > last then last, last_digits = tonumber(sq), sq end
    end
    local rec
    if deadline > 0 then
      rec = sq .. CHAR[prio] .. struct.pack('>d', deadline) .. payloads[i]
    else
      rec = sq .. CHAR[prio] .. NEVER .. payloads[i]
    end
    local v = state[field]
    if not v then
      state[field] = rec
      data[nd + 1], data[nd + 2] = field, rec
      nd = nd + 2
    else
      if grouped(v) then
        v = '#' .. (tonumber(string.sub(v, 2)) + 1)
      else  -- the key's second packet: both go under their seqs, into the group index
        local other = string.sub(v, 1, 16)
        data[nd + 1], data[nd + 2] = other, v
        members[nm + 1], members[nm + 2] = 0, field .. other
        nd, nm = nd + 2, nm + 2
        v = '#2'
        markers = markers + 1
      end
      state[field] = v
      data[nd + 1], data[nd + 2], data[nd + 3], data[nd + 4] = sq, rec, field, v
      members[nm + 1], members[nm + 2] = 0, field .. sq
      nd, nm = nd + 4, nm + 2
    end
    local ref = sq .. field
    if prio > 0 then
      levels[nl + 1], levels[nl + 2] = SCORE[prio], ref
      nl = nl + 2
    end
    if deadline > 0 then
      timed[nt + 1], timed[nt + 2] = deadline, ref
      nt = nt + 2
    end
  end
  data[nd + 1], data[nd + 2] = META, meta_value(last_digits, markers)
  bulk('HSET', d, data)
  bulk('ZADD', g, members)
  bulk('ZADD', s, levels)
  bulk('ZADD', x, timed)
  return nl > 0, markers
end
-- The seqs of a grouped key's packets (its ``field``) in push order, at most ``limit`` (-1: all).
local function group_seqs(g, field, limit)
  local members = redis.call('ZRANGEBYLEX', g, '[' .. field, '[' .. field .. '\255',
    'LIMIT', 0, limit)
  local seqs, skip = {}, #field + 1
  for i, member in ipairs(members) do seqs[i] = string.sub(member, skip) end
  return seqs
end
-- The record of each of ``refs`` (``state``: as ``read_state``, read here where it lacks),
-- and their fields.
local function records_of(d, refs, state)
  local fields = {}
  for i, ref in ipairs(refs) do fields[i] = string.sub(ref, 17) end
  read_state(d, fields, state)
  local recs, seqs, at = {}, {}, {}
  for i, ref in ipairs(refs) do
    local v = state[fields[i]]
    if grouped(v) then
      seqs[#seqs + 1] = string.sub(ref, 1, 16)
      at[#seqs] = i
    else
      recs[i] = v
    end
  end
  if #seqs > 0 then
    local values = hmget(d, seqs)
    for j, i in ipairs(at) do recs[i] = values[j] end
  end
  return recs, fields
end
-- Remove live packets, by ref, from every structure of the queue whose ``:d`` ``:s`` ``:g``
-- ``:x`` are given. ``state``: their fields' values as read before (``read_state``; what it
-- lacks is read here), updated; ``expiring``: whether ``:x`` may hold them (nil: look);
-- ``fields``: the refs' fields, when the caller has them already (nil: cut here).
local function unfile(d, s, g, x, refs, state, expiring, fields)
  if #refs == 0 then return end
  if not fields then
    fields = {}
    for i, ref in ipairs(refs) do fields[i] = string.sub(ref, 17) end
  end
  read_state(d, fields, state)
  local markers = markers_of(state[META])
  local was = markers
  -- The tables for key groups are made when a grouped packet is among them: most have none.
  local gone, members, counts, order, left = {}, nil, nil, nil, {}
  local n = 0
  for i = 1, #refs do
    local field = fields[i]
    local v = state[field]
    n = n + 1
    if grouped(v) then
      if not members then members, counts, order = {}, {}, {} end
      local ref = refs[i]
      local sq = string.sub(ref, 1, 16)
      gone[n] = sq
      members[#members + 1] = field .. sq
      if not counts[field] then
        counts[field] = tonumber(string.sub(v, 2))
        order[#order + 1] = field
      end
      counts[field] = counts[field] - 1
    else
      gone[n] = field
      state[field] = false
    end
  end
  for _, field in ipairs(order or {}) do
    local count = counts[field]
    if count == 0 then  -- a group stays a group down to one packet; gone at none
      gone[#gone + 1] = field
      state[field] = false
      markers = markers - 1
    else
      state[field] = '#' .. count
      left[#left + 1], left[#left + 2] = field, state[field]
    end
  end
  if markers ~= was then
    state[META] = meta_value(string.sub(state[META], 1, 16), markers)
    left[#left + 1], left[#left + 2] = META, state[META]
  end
  bulk('HDEL', d, gone)
  bulk('HSET', d, left)
  if members then bulk('ZREM', g, members) end
  bulk('ZREM', s, refs)  -- prio-0 refs among them are simply not members
  if expiring == nil then expiring = redis.call('EXISTS', x) == 1 end
  if expiring then bulk('ZREM', x, refs) end
end
-- Remove live packets (by ref) from the queue (KEYS d s g x). ``full``: return five fields a
-- packet (key, payload, prio, seq, deadline: enough to put it back), else two (key, payload).
local function remove_all(refs, full, state)
  local out = {}
  if #refs == 0 then return out end
  state = state or {}
  local recs, fields = records_of(KEYS[1], refs, state)
  for i, rec in ipairs(recs) do
    local n = #out
    out[n + 1], out[n + 2] = string.sub(fields[i], 3), string.sub(rec, 26)
    if full then
      out[n + 3], out[n + 4] = string.byte(rec, 17), string.sub(rec, 1, 16)
      out[n + 5] = tostring(deadline_of(rec))
    end
  end
  unfile(KEYS[1], KEYS[2], KEYS[3], KEYS[4], refs, state, nil)
  return out
end
-- Remove the packets whose deadline has come; returns how many.
local function sweep(now)
  local due = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
  remove_all(due, false)
  return #due
end
-- Delayed packets (decision 21) wait in KEYS[YI] (``:y``: seq -> the packet's delayed record,
-- its TTL deadline already its due time plus its TTL) and KEYS[YI + 1] (``:Y``: seq by due
-- time, ms on Redis's clock with microseconds); KEYS[YI + 2] is the queue's waiting mark
-- (``:w``). Until due a packet is in no other structure: not selectable, in no key group, no
-- TTL deadline. YI 0: the function takes none of these keys.
local YI = 0
local function channel_of(waiting) return string.sub(waiting, 1, -2) .. 'c' end
-- Move every delayed packet due by ``now`` into the queue under the seq its push took (its
-- place in push order), joining its key group; one whose TTL deadline has passed as well is
-- dropped (TTL wins). Publishes the queue's channel when a selectable packet entered and some
-- front end waits on the queue, as a push does. Returns how many entered, how many dropped.
local function promote(now)
  local due = redis.call('ZRANGEBYSCORE', KEYS[YI + 1], '-inf', now)
  if #due == 0 then return 0, 0 end
  local recs = hmget(KEYS[YI], due)
  local f = filing()
  for i, rec in ipairs(recs) do
    local deadline = struct.unpack('>d', string.sub(rec, 2, 9))
    if deadline == 0 or deadline > now then
      local klen = key_length(rec)
      file_packet(f, string.sub(rec, 10, 11 + klen), due[i], string.byte(rec, 1), deadline,
        string.sub(rec, 12 + klen))
    end
  end
  bulk('HDEL', KEYS[YI], due)
  redis.call('ZREMRANGEBYSCORE', KEYS[YI + 1], '-inf', now)
  if filed(f, KEYS[1], KEYS[2], KEYS[3], KEYS[4])
      and redis.call('EXISTS', KEYS[YI + 2]) == 1 then
    redis.call('PUBLISH', channel_of(KEYS[YI + 2]), '')
  end
  return #f.fields, #due - #f.fields
end
-- Promote what is due and sweep what expired, on a queue that has delayed packets or TTL
-- deadlines; most have neither, and then one EXISTS is all this costs (no TIME, no range).
-- Returns whether it had any (so removals must update the deadline index), then how many
-- entered and how many expired.
local function sweep_due()
  local timed
  if YI > 0 then
    timed = redis.call('EXISTS', KEYS[4], KEYS[YI + 1])
  else
    timed = redis.call('EXISTS', KEYS[4])
  end
  if timed == 0 then return false, 0, 0 end
  local now = now_precise()
  local entered, dropped = 0, 0
  if YI > 0 then entered, dropped = promote(now) end
  return true, entered, dropped + sweep(now)
end
-- KEYS[LI]: the queue's lease table (``:l``; every function that may forget the queue takes it).
local LI = 0
-- Whether delayed or leased packets hold sequence numbers of the queue: while they do, its
-- last sequence number stays, so a new push takes none of theirs, nor an older one (a leased
-- packet goes back under its old one, decision 15; a batch's numbers run ahead of the clock).
local function seqs_held()
  if YI > 0 then return redis.call('EXISTS', KEYS[YI], KEYS[LI]) > 0 end
  return redis.call('EXISTS', KEYS[LI]) > 0
end
-- The queue holds no packet: forget it entirely (decision 5), but for its meta field (its last
-- sequence number) while ``seqs_held``.
local function forget()
  if not seqs_held() then redis.call('DEL', KEYS[1]) end
end
local function forget_if_empty()
  if redis.call('HLEN', KEYS[1]) <= 1 then forget() end
end
-- The earliest due time of the queue's delayed packets, 0 for none.
local function next_due()
  local head = redis.call('ZRANGE', KEYS[YI + 1], 0, 0, 'WITHSCORES')
  return tonumber(head[2] or '0')
end
"""

#: KEYS d s g x w; ARGV channel, figures ('1': count the queue's packets, for the front end's
#: figures; its batch's last push of the queue asks), then four fields a packet: key payload
#: ttl_ms prio. Pushes them in order (a batch's consecutive pushes to one queue are one call:
#: each is still whole, and no other script runs between them). Returns the earliest deadline
#: in ms (0 for none) and the packets the queue holds (-1: not counted). No ``allow-oom``:
#: Redis refuses it while over ``maxmemory``, before it runs.
PUSH = r"""
local now, _, clock = now_ms()
local f, earliest = filing(), 0
-- The filing's columns filled here, not by ``file_packet``: a Lua call a packet costs more
-- than this loop's other work.
local fields, prios, deadlines, payloads, n = f.fields, f.prios, f.deadlines, f.payloads, 0
for i = 3, #ARGV, 4 do
  local ttl, deadline = ARGV[i + 2], 0
  if ttl ~= '0' then
    deadline = now + tonumber(ttl)
    if earliest == 0 or deadline < earliest then earliest = deadline end
  end
  local key = ARGV[i]
  n = n + 1
  local length = LEN2[#key]  -- field_of's, inline; it fills the table for a new length
  fields[n] = length and length .. key or field_of(key)
  prios[n] = PRIO[ARGV[i + 3]] or tonumber(ARGV[i + 3])  -- the table knows '0'..'255'
  deadlines[n], payloads[n] = deadline, ARGV[i + 1]
end
f.n = n
local selectable, markers = filed(f, KEYS[1], KEYS[2], KEYS[3], KEYS[4], clock)
if selectable and redis.call('EXISTS', KEYS[5]) == 1 then redis.call('PUBLISH', ARGV[1], '') end
local held = -1
if ARGV[2] == '1' then held = redis.call('HLEN', KEYS[1]) - 1 - markers end
return {earliest, held}
"""

#: KEYS d y Y w; ARGV five fields a packet: key payload ttl_ms prio delay_ms (delay > 0). Holds
#: delayed pushes (decision 21) in order: each takes its seq (its place in push order) now, from
#: the queue's counter in ``:d``, its due time is Redis's clock plus its delay, its TTL deadline
#: its due time plus its TTL. When some front end waits on the queue, publishes its channel with
#: the earliest due time (ms), so that front end times the promotion too (the pusher may die
#: first). Returns that earliest due time and how many delayed packets the queue holds. No
#: ``allow-oom``, as ``push``.
PUSH_DELAYED = r"""
YI = 2
local now, t = now_precise()
local last, markers = meta_of(redis.call('HGET', KEYS[1], META))
local seq = clock_us(t)
if seq <= last then seq = last + 1 end
local data, dues, earliest, s, head = {}, {}, 0, nil, nil
for i = 1, #ARGV, 5 do
  local ttl, prio = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local due = now + tonumber(ARGV[i + 4])
  local deadline = 0
  if ttl > 0 then deadline = due + ttl end
  s, head = seq_digits(seq, head)
  data[#data + 1] = s
  data[#data + 1] = delayed_record(prio, deadline, field_of(ARGV[i]), ARGV[i + 1])
  dues[#dues + 1] = due
  dues[#dues + 1] = s
  if earliest == 0 or due < earliest then earliest = due end
  seq = seq + 1
end
bulk('HSET', KEYS[2], data)
bulk('ZADD', KEYS[3], dues)
redis.call('HSET', KEYS[1], META, meta_value(s, markers))
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('PUBLISH', channel_of(KEYS[4]), string.format('%.3f', earliest))
end
return {tostring(earliest), redis.call('HLEN', KEYS[2])}
"""

# The pop function's machinery (``POP``), defined once when Redis loads the library rather than
# at each call: a call's state lives in these upvalues, set afresh by ``pop_all``.
_POP_HELPERS = r"""
-- Results the front end has confirmed it holds (a pop's ARGV from the 7th): no longer kept.
-- Forgotten after the call's own is kept, so that a hash that held them is never empty in
-- between (then it keeps its lifetime).
local function forget_confirmed()
  if #ARGV > 6 then return redis.call('HDEL', KEYS[5], unpack(ARGV, 7)) end
  return 0
end
-- One pop call's choosing. Removals wait until every pop of the call has chosen (one HDEL and
-- one ZREM a structure for the whole call, not per pop); meanwhile ``taken`` keeps a packet
-- from being chosen twice, and the selection set is read in pages of candidates, best first,
-- with their fields' values (records or markers) in one HMGET a page. ``refs`` and
-- ``ref_fields``: what was taken and each one's field. A lone key's packet is met once, in
-- its page; a grouped one also in its group's range, so only grouped packets go into
-- ``taken``, and ``taken_of`` counts how many of a grouped key's were taken.
-- ``out``: the call's reply, one flat list (``nout`` items so far): each pop's item count,
-- then its items (a nested table a pop would cost Redis a deferred array length each).
local taken, refs, nrefs, ref_fields, taken_of, state
local page, page_fields, page_n, at, start
local max_pop, full, out, nout
local function take(ref, field)
  local n = nrefs + 1
  refs[n], ref_fields[n], nrefs = ref, field, n
end
local function take_grouped(ref, field)
  taken[ref] = true
  take(ref, field)
  taken_of[field] = (taken_of[field] or 0) + 1
end
-- The best packet not yet taken: its ref and field; or nil.
local function best(wanted)
  while true do
    if at > page_n then
      page = redis.call('ZRANGE', KEYS[2], start, start + math.min(wanted, 1000) - 1, 'REV')
      page_n = #page
      if page_n == 0 then return nil end
      start, at, page_fields = start + page_n, 1, {}
      for i = 1, page_n do page_fields[i] = string.sub(page[i], 17) end
      read_state(KEYS[1], page_fields, state)
    end
    local i = at
    at = i + 1
    local ref = page[i]
    if not taken[ref] then return ref, page_fields[i] end
  end
end
-- Add a packet (its key's field, its record) to the reply: as they are (the front end cuts
-- the key and payload out: two Lua strings fewer a packet), or with ``full`` five fields.
local function packet(field, rec)
  local n = nout
  if not full then
    out[n + 1], out[n + 2], nout = field, rec, n + 2
    return
  end
  out[n + 1], out[n + 2] = string.sub(field, 3), string.sub(rec, 26)
  out[n + 3], out[n + 4] = string.byte(rec, 17), string.sub(rec, 1, 16)
  out[n + 5], nout = tostring(deadline_of(rec)), n + 5
end
-- One pop (``left``: how many the call still makes, for the page size): the best packet and
-- the rest of its key group, added to the reply.
local function pop_one(left)
  local ref, field = best(left)
  if not ref then return end
  local v = state[field]
  if not grouped(v) then  -- a lone key: its record was read with the page
    take(ref, field)
    packet(field, v)
    return
  end
  -- The rest of its key group in push order; packets taken by earlier pops of this call are
  -- still in the index, so the range reaches past them.
  local before = taken_of[field] or 0
  take_grouped(ref, field)
  local seqs = {string.sub(ref, 1, 16)}
  for _, sq in ipairs(group_seqs(KEYS[3], field, max_pop + before)) do
    if #seqs >= max_pop then break end
    local other = sq .. field
    if not taken[other] then
      seqs[#seqs + 1] = sq
      take_grouped(other, field)
    end
  end
  for _, rec in ipairs(hmget(KEYS[1], seqs)) do packet(field, rec) end
end
-- ``pops`` pops of the queue (KEYS d s g): the reply (each pop's item count, then its items),
-- its length, then what they took (refs, their fields) and the fields' values read meanwhile
-- (``read_state``'s).
local function pop_all(pops, most, whole)
  taken, refs, nrefs, ref_fields, taken_of, state = {}, {}, 0, {}, {}, {}
  page, page_n, at, start = nil, 0, 1, 0
  max_pop, full, out, nout = most, whole, {}, 0
  for i = 1, pops do
    local head = nout + 1
    nout = head
    pop_one(pops - i + 1)
    out[head] = nout - head
  end
  local reply, n, chosen, their_fields, read = out, nout, refs, ref_fields, state
  taken, refs, ref_fields, taken_of, state, page, page_fields, out =
    nil, nil, nil, nil, nil, nil, nil, nil
  return reply, n, chosen, their_fields, read
end
"""

#: KEYS d s g x r y Y w l; ARGV max_pop, pops, full, call id, retry ('1' if sent before),
#: refresh ('1': renew the kept results' lifetime), then the call ids whose results the front
#: end has. Promotes and sweeps what is due, then ``pops`` times removes the best packet and
#: its key group (decisions 2-4). Returns one flat list: for each pop how many items it has,
#: then its items, two a packet (its field and its record: ``KEY_AT`` and ``PAYLOAD_AT`` say
#: where its key and payload start) or with ``full`` = 1 five (key, payload, prio, seq,
#: deadline: enough for a delivery nobody could take to go back unchanged); then the
#: selectable packets left (with ``full`` only; else 0), and all the packets left (-1: not
#: counted, when it removed nothing). A call that took packets keeps that reply under its id
#: in ``:r``.
#: ``allow-oom``: a pop only frees memory, and a full Redis must still drain.
POP = r"""
local call_id = ARGV[4]
-- A call sent again (its reply was lost: Redis restarted, the connection broke) answers with
-- what it took the first time, if it ran then: so no packet is removed for nobody.
if ARGV[5] == '1' then
  local kept = redis.call('HGET', KEYS[5], call_id)
  if kept then
    forget_confirmed()
    return cmsgpack.unpack(kept)
  end
end
YI, LI = 6, 9
local expiring, _, expired = sweep_due()
local replies, n, refs, fields, state = pop_all(tonumber(ARGV[2]), tonumber(ARGV[1]),
  ARGV[3] == '1')
unfile(KEYS[1], KEYS[2], KEYS[3], KEYS[4], refs, state, expiring, fields)
-- Last, the packets held (for the front end's figures; only by a call that removed some: one
-- that found the queue empty, a consumer polling, costs two calls, EXISTS and ZRANGE) and,
-- for a delivery, how many selectable ones are left (a subscriber's front end stops there; 0
-- otherwise: unread). A queue this call emptied is forgotten.
local held = -1
if #refs > 0 or expired > 0 then
  held = held_count(KEYS[1], state)
  if held == 0 then forget() end
end
replies[n + 1] = ARGV[3] == '1' and redis.call('ZCARD', KEYS[2]) or 0
replies[n + 2] = held
if #refs > 0 then
  -- Kept until the front end confirms it has the reply (a later call's ARGV, or its cleanup
  -- every few seconds). The key lives a day, which only bounds what a front end that died
  -- leaves behind: set when the hash may be new (this call forgot none of its fields: so
  -- every hash that appears gets it at once), and renewed when the front end asks (``refresh``,
  -- its first pop of the queue every few seconds), not at every call.
  redis.call('HSET', KEYS[5], call_id, cmsgpack.pack(replies))
  if forget_confirmed() == 0 or ARGV[6] == '1' then
    redis.call('PEXPIRE', KEYS[5], 86400000)
  end
else
  forget_confirmed()
end
return replies
"""

#: KEYS d s g x y Y w l; no ARGV. Promotes and sweeps what is due and returns the rank of what
#: a pop would select: {prio, seq}, or {} if nothing is selectable.
RANK = r"""
YI, LI = 5, 8
sweep_due()
forget_if_empty()
local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
if #top == 0 then return {} end
return {-tonumber(top[2]), string.sub(top[1], 1, 16)}
"""

#: KEYS d s g x y Y w l; no ARGV. Moves the delayed packets that are due into the queue and
#: removes the packets whose deadline has come. Returns {how many expired, how many entered,
#: the next due time in ms or 0, how many packets the queue holds}.
SWEEP = r"""
YI, LI = 5, 8
local _, entered, expired = sweep_due()
local held = held_count(KEYS[1], {})
if held == 0 then forget() end
return {expired, entered, tostring(next_due()), held}
"""

#: KEYS d s g x y Y l; no ARGV. Removes every packet (prio 0 and delayed ones included; leased
#: ones are not in the queue, and keep the last sequence number: ``seqs_held``); returns {how
#: many queued, how many delayed}.
PURGE = r"""
LI = 7
local state = {}
local n, delayed = held_count(KEYS[1], state), redis.call('HLEN', KEYS[5])
if state[META] == nil then state[META] = redis.call('HGET', KEYS[1], META) or false end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
if state[META] and seqs_held() then
  redis.call('HSET', KEYS[1], META, string.sub(state[META], 1, 16))
end
return {n, delayed}
"""

#: KEYS d s g x w; ARGV channel, then five fields a packet as POP returns them with ``full``.
#: Puts packets back as they were (prio, place in push order, deadline); drops those whose TTL
#: has passed. Returns how many went back. ``allow-oom``: the memory was held a moment ago.
RESTORE = r"""
local now = now_ms()
local f = filing()
for i = 2, #ARGV, 5 do
  local deadline = tonumber(ARGV[i + 4])
  if deadline == 0 or deadline > now then
    file_packet(f, field_of(ARGV[i]), ARGV[i + 3], tonumber(ARGV[i + 2]), deadline, ARGV[i + 1])
  end
end
local selectable = filed(f, KEYS[1], KEYS[2], KEYS[3], KEYS[4])
if selectable and redis.call('EXISTS', KEYS[5]) == 1 then redis.call('PUBLISH', ARGV[1], '') end
return #f.fields
"""

#: KEYS d s g x; ARGV count max_pop. What the next pops would return, in order, removing
#: nothing (and sweeping nothing: it skips expired packets). Flat list: key, payload, prio.
PEEK = r"""
local count, max_pop = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local taken, out, found, state, start = {}, {}, 0, {}, 0
local function live(rec)
  local deadline = deadline_of(rec)
  return deadline == 0 or deadline > now
end
local function add(field, rec)
  out[#out + 1] = string.sub(field, 3)
  out[#out + 1] = string.sub(rec, 26)
  out[#out + 1] = string.byte(rec, 17)
  found = found + 1
end
while found < count do
  local page = redis.call('ZRANGE', KEYS[2], start, start + 99, 'REV')
  if #page == 0 then break end
  start = start + 100
  local fields = {}
  for i, ref in ipairs(page) do fields[i] = string.sub(ref, 17) end
  read_state(KEYS[1], fields, state)
  for i, ref in ipairs(page) do
    if found >= count then break end
    local field = fields[i]
    if not taken[ref] then
      -- The selected packet first, then the rest of its key group in push order.
      local seqs, recs = {string.sub(ref, 1, 16)}, {state[field]}
      if grouped(recs[1]) then
        for _, sq in ipairs(group_seqs(KEYS[3], field, -1)) do
          if sq ~= seqs[1] then seqs[#seqs + 1] = sq end
        end
        recs = hmget(KEYS[1], seqs)
      end
      if live(recs[1]) then
        taken[ref] = true
        add(field, recs[1])
        local in_reply = 1
        for j = 2, #seqs do
          if found >= count or in_reply >= max_pop then break end
          local other = seqs[j] .. field
          if not taken[other] and live(recs[j]) then
            taken[other] = true
            in_reply = in_reply + 1
            add(field, recs[j])
          end
        end
      end
    end
  end
end
return out
"""


# -- move (decision 22) -----------------------------------------------------------------------

_MOVE_HELPERS = r"""
-- Packets a round of a cross-slot move of all takes (whole groups, so it may take more).
local MOVE_ROUND = 10000
-- Whether a field of ``:d`` is a seq (a grouped packet's): 16 bytes starting with a digit.
local function is_seq(field) return #field == 16 and string.byte(field, 1) >= 48 end
-- The refs of the queue's packets a move of at most ``limit`` packets takes (0: every queued
-- one), in push order: whole key groups, chosen in pop order (best selectable packet first),
-- while fewer than ``limit`` have been taken; so prio-0 packets whose key has no selectable
-- packet move only when ``limit`` is 0.
local function move_selection(limit)
  local refs = {}
  if limit == 0 then
    local all = redis.call('HGETALL', KEYS[1])
    for i = 1, #all, 2 do
      local field, v = all[i], all[i + 1]
      if field ~= META and not is_seq(field) and not grouped(v) then
        refs[#refs + 1] = string.sub(v, 1, 16) .. field
      end
    end
    for _, member in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
      refs[#refs + 1] = string.sub(member, -16) .. string.sub(member, 1, -17)
    end
    table.sort(refs)  -- fixed-width digits first: string order is push order
    return refs
  end
  local taken, state, start = {}, {}, 0
  while #refs < limit do
    local page = redis.call('ZRANGE', KEYS[2], start, start + 99, 'REV')
    if #page == 0 then break end
    start = start + #page
    local fields = {}
    for i, ref in ipairs(page) do fields[i] = string.sub(ref, 17) end
    read_state(KEYS[1], fields, state)
    for i, ref in ipairs(page) do
      if #refs >= limit then break end
      if not taken[ref] then
        local field = fields[i]
        local group = {ref}
        if grouped(state[field]) then
          group = {}
          for _, sq in ipairs(group_seqs(KEYS[3], field, -1)) do group[#group + 1] = sq .. field end
        end
        for _, member in ipairs(group) do
          taken[member] = true
          refs[#refs + 1] = member
        end
      end
    end
  end
  table.sort(refs)
  return refs
end
-- Take ``refs`` out of the queue (KEYS d s g x, attempt counts at ``attempts``) for a move:
-- five fields a packet, as ``remove_all`` gives them; their attempt counts are dropped
-- (decision 22: they start again).
local function take_for_move(refs, attempts)
  local packets = remove_all(refs, true)
  if #refs > 0 and redis.call('EXISTS', attempts) == 1 then
    local seqs = {}
    for i, ref in ipairs(refs) do seqs[i] = string.sub(ref, 1, 16) end
    bulk('HDEL', attempts, seqs)
  end
  forget_if_empty()
  return packets
end
-- Push moved packets (five fields each, from ``o`` in ``t``) into the queue whose keys are
-- ``tk`` = {d, s, g, x, w} as pushes made now, in their order, each keeping its prio and TTL
-- deadline; a packet whose deadline passed meanwhile is dropped. Returns how many entered and
-- the earliest deadline (0 for none).
local function push_moved(tk, t, o)
  local now, clock = now_precise()
  local f, earliest = filing(), 0
  for i = o, #t, 5 do
    local deadline = tonumber(t[i + 4])
    if deadline == 0 or deadline > now then
      file_packet(f, field_of(t[i]), nil, tonumber(t[i + 2]), deadline, t[i + 1])
      if deadline > 0 and (earliest == 0 or deadline < earliest) then earliest = deadline end
    end
  end
  if f.n == 0 then return 0, 0 end
  if filed(f, tk[1], tk[2], tk[3], tk[4], clock_us(clock))
      and redis.call('EXISTS', tk[5]) == 1 then
    redis.call('PUBLISH', channel_of(tk[5]), '')
  end
  return f.n, earliest
end
"""

#: KEYS: the source's d s g x y Y w l a, then the target's d s g x w (one Cluster slot); ARGV
#: limit (0: all). Moves whole key groups, in pop order, while fewer than ``limit`` packets
#: have moved (decision 22): due delayed packets are promoted and expired ones swept first;
#: leased and delayed packets stay. Returns {how many moved, how many entered (fewer when a
#: TTL passed meanwhile), the earliest TTL deadline among them (0: none), packets left in the
#: source, packets in the target}.
MOVE = r"""
YI, LI = 5, 8
sweep_due()
local refs = move_selection(tonumber(ARGV[1]))
local packets = take_for_move(refs, KEYS[9])
local entered, earliest = push_moved({unpack(KEYS, 10, 14)}, packets, 1)
return {#refs, entered, tostring(earliest), held_count(KEYS[1], {}), held_count(KEYS[10], {})}
"""

#: KEYS: the source's d s g x y Y w l a m; ARGV limit, move id, the target's name. The first
#: half of a move between two Cluster slots: takes what a move of ``limit`` would take (0: a
#: round of whole groups of about ``MOVE_ROUND`` packets, then, once nothing selectable is left,
#: every prio-0 packet left) and keeps it in ``:m`` under the move id (with Redis's time and the
#: target's name) until ``move_in`` has put it into the target and the front end deletes it; a
#: front end that dies between the two leaves it there for any front end's scan to finish.
#: Returns the packets in push order, five fields each (none: nothing to move).
MOVE_OUT = r"""
YI, LI = 5, 8
sweep_due()
local limit = tonumber(ARGV[1])
local refs = move_selection(limit > 0 and limit or MOVE_ROUND)
if #refs == 0 and limit == 0 then refs = move_selection(0) end
local packets = take_for_move(refs, KEYS[9])
if #packets > 0 then
  local kept = {now_ms(), ARGV[3]}
  for _, v in ipairs(packets) do kept[#kept + 1] = v end
  redis.call('HSET', KEYS[10], ARGV[2], cmsgpack.pack(kept))
end
return packets
"""

#: KEYS: the target's d s g x w M; ARGV move id, then five fields a packet as ``move_out``
#: gave them. The second half: pushes the group into the target as ``move`` does, once per move
#: id (``:M`` remembers the ids it applied for a day, so a call sent again, or a scan finishing
#: a dead front end's move, applies it once). Returns how many entered. No ``allow-oom``.
MOVE_IN = r"""
if redis.call('SISMEMBER', KEYS[6], ARGV[1]) == 1 then return 0 end
local entered = push_moved({unpack(KEYS, 1, 5)}, ARGV, 2)
redis.call('SADD', KEYS[6], ARGV[1])
redis.call('PEXPIRE', KEYS[6], 86400000)
return entered
"""

#: KEYS a queue's m; ARGV age in ms. The groups of cross-slot moves kept there for longer than
#: that (their front end died between the halves): {move id, target name, five fields a
#: packet} each, for a scan to finish their moves.
MOVES_KEPT = r"""
local now, out = now_ms(), {}
local kept = redis.call('HGETALL', KEYS[1])
for i = 1, #kept, 2 do
  local t = cmsgpack.unpack(kept[i + 1])
  if now - t[1] >= tonumber(ARGV[1]) then
    local packets = {}
    for j = 3, #t do packets[#packets + 1] = t[j] end
    out[#out + 1] = {kept[i], t[2], packets}
  end
end
return out
"""


# -- leases (decisions 13-19) ---------------------------------------------------------------
#
# Every lease function takes fifteen KEYS: the queue's d s g x, its delayed packets y, their
# due times Y, its waiting mark w, its l (hash: handle -> the lease, cmsgpack {attempt, then six
# fields a packet: key payload prio seq deadline count}), L (sorted set: handle by deadline in
# ms, or by the end of a release delay) and a (hash: seq -> how many leases of the packet ended
# other than by ack; absent for none); then its dead-letter queue's d s g x w (one slot:
# keys.py). ARGV starts with the queue's channel, the dead queue's channel, max deliveries (0:
# never) and '1' if the dead queue may be used ('0': its name would be too long, so a group due
# there is dropped). A lease lives exactly while ``:l`` holds it.
_LEASE_HELPERS = r"""
local max_deliveries, dead_ok
-- Where the dead queue's keys start, and the lease table's and attempt counts' keys.
local DEAD, LEASES, DUES, ATTEMPTS = 10, 8, 9, 10
-- Every lease function starts here: ARGV 3 and 4 are the same for all of them.
local function lease_args()
  max_deliveries, dead_ok = tonumber(ARGV[3]), ARGV[4] == '1'
  YI = 5  -- the queue's delayed packets, their due times, its waiting mark
  LI = LEASES
end
-- Put a lease's packets into the queue at KEYS offset ``o`` (0: the queue, DEAD: its dead
-- queue; ``waiting`` its waiting mark) as they were; drops those whose TTL passed (TTL wins).
-- ``bump``: each packet's count one more (nil: counts reset, for the dead queue). Returns how
-- many went back.
local function put_back(o, waiting, channel, t, bump, now)
  local f, counts = filing(), {}
  for i = 2, #t, 6 do
    local s, deadline, count = t[i + 3], t[i + 4], t[i + 5]
    if deadline == 0 or deadline > now then
      file_packet(f, field_of(t[i]), s, t[i + 2], deadline, t[i + 1])
      if o == 0 and count + bump > 0 then
        counts[#counts + 1] = s
        counts[#counts + 1] = count + bump
      end
    end
  end
  local selectable = filed(f, KEYS[o + 1], KEYS[o + 2], KEYS[o + 3], KEYS[o + 4])
  bulk('HSET', KEYS[ATTEMPTS], counts)
  if selectable and redis.call('EXISTS', waiting) == 1 then
    redis.call('PUBLISH', channel, '')
  end
  return #f.fields
end
-- End a lease other than by ack: its packets go back, counted (``counted`` false: a delivery
-- nobody could take, not an attempt), or after max deliveries to the dead queue.
-- Returns {back, dead, dropped}.
local function end_lease(handle, counted, now)
  local rec = redis.call('HGET', KEYS[LEASES], handle)
  redis.call('HDEL', KEYS[LEASES], handle)
  redis.call('ZREM', KEYS[DUES], handle)
  if not rec then return {0, 0, 0} end
  local t = cmsgpack.unpack(rec)
  if counted and max_deliveries > 0 and t[1] >= max_deliveries then
    if dead_ok then return {0, put_back(DEAD, KEYS[DEAD + 5], ARGV[2], t, nil, now), 0} end
    return {0, 0, (#t - 1) / 6}
  end
  local bump = 0
  if counted then bump = 1 end
  return {put_back(0, KEYS[7], ARGV[1], t, bump, now), 0, 0}
end
-- End every lease of the queue whose deadline (or release delay) has come.
local function sweep_leases(now)
  local totals = {0, 0, 0}
  local due = redis.call('ZRANGEBYSCORE', KEYS[DUES], '-inf', now)
  for _, handle in ipairs(due) do
    local r = end_lease(handle, true, now)
    for i = 1, 3 do totals[i] = totals[i] + r[i] end
  end
  return totals, due
end
-- Once neither the queue nor a lease holds a packet, forget it entirely (decision 5).
local function forget_all_if_empty()
  if redis.call('HLEN', KEYS[1]) <= 1 then
    forget()
    if redis.call('EXISTS', KEYS[LEASES]) == 0 then redis.call('DEL', KEYS[ATTEMPTS]) end
  end
end
"""

#: 15 KEYS, ARGV as above, then max_pop, handle, lease_ms. Ends the queue's due leases and
#: sweeps its due packets, then leases what a pop would take (decision 13) under ``handle``.
#: Returns {} if nothing is selectable, else {attempt, deadline ms, selectable left, then key,
#: payload a packet}.
RESERVE = r"""
lease_args()
local max_pop, handle, lease_ms = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local now = now_ms()
sweep_leases(now)
promote(now_precise())
sweep(now)
local top = redis.call('ZRANGE', KEYS[2], -1, -1)
if #top == 0 then
  forget_all_if_empty()
  return {}
end
local selected = top[1]
local field = string.sub(selected, 17)
local state = read_state(KEYS[1], {field}, {})
local refs, seqs = {selected}, {string.sub(selected, 1, 16)}
if grouped(state[field]) then
  for _, sq in ipairs(group_seqs(KEYS[3], field, max_pop)) do
    if #refs >= max_pop then break end
    if sq ~= seqs[1] then
      refs[#refs + 1] = sq .. field
      seqs[#seqs + 1] = sq
    end
  end
end
local counts = {}
if redis.call('EXISTS', KEYS[ATTEMPTS]) == 1 then
  counts = hmget(KEYS[ATTEMPTS], seqs)
  bulk('HDEL', KEYS[ATTEMPTS], seqs)
end
local packets = remove_all(refs, true, state)
local t, out, most = {0}, {}, 0
for j = 1, #refs do
  local i = (j - 1) * 5
  local count = tonumber(counts[j]) or 0
  if count > most then most = count end
  local n = #t
  t[n + 1], t[n + 2], t[n + 3] = packets[i + 1], packets[i + 2], packets[i + 3]
  t[n + 4], t[n + 5], t[n + 6] = packets[i + 4], tonumber(packets[i + 5]), count
  out[2 * j - 1], out[2 * j] = packets[i + 1], packets[i + 2]
end
t[1] = most + 1
local due = now + lease_ms
redis.call('HSET', KEYS[LEASES], handle, cmsgpack.pack(t))
redis.call('ZADD', KEYS[DUES], due, handle)
forget_all_if_empty()
local reply = {t[1], due, redis.call('ZCARD', KEYS[2])}
for _, v in ipairs(out) do reply[#reply + 1] = v end
return reply
"""

#: 15 KEYS, ARGV as above, then op, handle, ms. What an ack ('ack'), release ('release', ms the
#: delay), touch ('touch', ms the new lease time) or a delivery nobody could take ('unreserve')
#: does to a lease. A lease whose deadline has passed is ended here (its packets go back) and
#: answers as not live. Returns {live (1/0), back, dead, dropped, the lease's new due ms or 0}.
LEASE_OP = r"""
lease_args()
local op, handle, ms = ARGV[5], ARGV[6], tonumber(ARGV[7])
local now = now_ms()
local due = redis.call('ZSCORE', KEYS[DUES], handle)
if not due then return {0, 0, 0, 0, 0} end
if tonumber(due) <= now then
  local r = end_lease(handle, true, now)
  forget_all_if_empty()
  return {0, r[1], r[2], r[3], 0}
end
local r, new_due = {0, 0, 0}, 0
if op == 'ack' then
  redis.call('HDEL', KEYS[LEASES], handle)
  redis.call('ZREM', KEYS[DUES], handle)
elseif op == 'unreserve' then
  r = end_lease(handle, false, now)
elseif op == 'release' and ms == 0 then
  r = end_lease(handle, true, now)
else  -- touch, or a release with a delay: the lease ends (or its packets go back) at new_due
  new_due = now + ms
  redis.call('ZADD', KEYS[DUES], new_due, handle)
end
forget_all_if_empty()
return {1, r[1], r[2], r[3], new_due}
"""

#: 15 KEYS, ARGV as above. Ends every lease of the queue whose deadline or release delay has
#: come. Returns {back, dead, dropped, the next due ms or 0, then the handles ended}.
LEASE_SWEEP = r"""
lease_args()
local totals, ended = sweep_leases(now_ms())
forget_all_if_empty()
local next_due = redis.call('ZRANGE', KEYS[DUES], 0, 0, 'WITHSCORES')
local reply = {totals[1], totals[2], totals[3], tonumber(next_due[2] or '0')}
for _, handle in ipairs(ended) do reply[#reply + 1] = handle end
return reply
"""


# -- the library ------------------------------------------------------------------------------

#: The layout of the keys and the calling convention of the functions. A front end loads the
#: library ``pinpriq_<LAYOUT>`` once (``FUNCTION LOAD``); Redis keeps it (in its RDB and AOF
#: too) and every front end calls the same functions. Bump it with any change to the scripts.
LAYOUT = 6
LIBRARY_NAME = f"pinpriq_{LAYOUT}"
#: The oldest layout whose keys this one reads as they are (layout 6 changed only functions):
#: its queues are upgraded by deleting its library once its front ends are stopped.
KEYS_SINCE = 5

#: Each function: its body and its flags (``allow-oom``: it only frees memory or puts back what
#: was held a moment ago, so a full Redis still runs it; none: Redis refuses it over maxmemory).
_FUNCTIONS = {
    "push": (PUSH, ""),
    "push_delayed": (PUSH_DELAYED, ""),
    "move": (MOVE, "'allow-oom'"),
    "move_out": (MOVE_OUT, "'allow-oom'"),
    "move_in": (MOVE_IN, ""),
    "moves_kept": (MOVES_KEPT, "'no-writes'"),
    "pop": (POP, "'allow-oom'"),
    "rank": (RANK, "'allow-oom'"),
    "sweep": (SWEEP, "'allow-oom'"),
    "purge": (PURGE, "'allow-oom'"),
    "restore": (RESTORE, "'allow-oom'"),
    "peek": (PEEK, "'no-writes'"),
    "reserve": (RESERVE, "'allow-oom'"),
    "lease_op": (LEASE_OP, "'allow-oom'"),
    "lease_sweep": (LEASE_SWEEP, "'allow-oom'"),
}


#: The field of a queue's ``:d`` hash that holds its last sequence number and marker count.
META = b"q"
#: Where a packet's key starts in its field (after its u16 length), and its payload in its
#: record (after its seq, prio and deadline): a plain pop returns both as stored.
KEY_AT = 2
PAYLOAD_AT = 25


def packets_held(fields: int, meta: bytes | None) -> int:
    """The packets a queue holds, from its ``:d`` hash's length and ``META`` field: every field
    is a packet's but the meta field and the markers."""
    if fields <= 1 or meta is None:
        return 0
    return fields - 1 - int(meta[16:] or 0)


def function_name(operation: str) -> str:
    """What ``FCALL`` names for one operation of this layout."""
    return f"{LIBRARY_NAME}_{operation}"


def _register(operation: str, body: str, flags: str) -> str:
    return (
        f"local function op_{operation}()\n{body}end\n"
        f"redis.register_function{{function_name='{function_name(operation)}', "
        "callback=function(keys, args) KEYS, ARGV, YI, LI = keys, args, 0, 0; tables(); "
        f"return op_{operation}() end, "
        f"flags={{{flags}}}}}\n"
    )


#: The whole library. The helpers are defined once, when Redis loads it, not on every call as
#: a script's would be; each call sets ``KEYS`` and ``ARGV`` (upvalues, not globals: a
#: function library may not write globals) before it runs.
LIBRARY = (
    f"#!lua name={LIBRARY_NAME}\n"
    "local KEYS, ARGV\n"
    + _HELPERS
    + _POP_HELPERS
    + _MOVE_HELPERS
    + _LEASE_HELPERS
    + "".join(_register(op, body, flags) for op, (body, flags) in _FUNCTIONS.items())
)
