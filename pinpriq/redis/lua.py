"""The server-side scripts of the Redis store: each push, pop, sweep and purge is one of these,
so each is atomic in Redis whatever other front ends do at the same moment.

Layout of one queue (every key carries the queue's hash tag, so all of them, and those of its
dead-letter queues, live in one Cluster slot; ``keys.py`` builds the names):

* ``:d`` hash, sequence number -> the packet: ``prio u8 | deadline (ms, double) | key length
  u16 | key | payload``. A packet is live exactly while this hash holds it.
* ``:s`` sorted set of the selectable packets (prio 1..255): score ``-prio``, member the
  sequence number, so the *last* member is the lowest prio and, among equal prios, the newest
  (equal scores order by member, and sequence numbers are fixed-width digits).
* ``:g`` sorted set of every packet by key group: member ``key length u16 | key | seq`` (16
  digits), score 0, so one lexicographic range is a key group in push order.
* ``:x`` sorted set of the packets with a TTL: score the deadline in ms on Redis's clock.
* ``:q`` the last sequence number given: Redis's ``TIME`` in microseconds, bumped by one when
  two pushes fall in the same microsecond, so "newest" is push order within a queue and, across
  queues of one Redis, the order of Redis's clock.
* ``:w`` exists while some front end has subscribers waiting on the queue: a push of a
  selectable packet then publishes the queue's channel (``ARGV``), and only then.

Sequence numbers are below 2^53, so Lua's doubles hold them exactly; ``%016.0f`` writes them.
Deadline 0 means "never" (TTL 0).
"""

from __future__ import annotations

__all__ = [
    "LAYOUT",
    "LEASE_OP",
    "LEASE_SWEEP",
    "LIBRARY",
    "LIBRARY_NAME",
    "MOVE",
    "MOVES_KEPT",
    "MOVE_IN",
    "MOVE_OUT",
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
]


# Shared helpers, prepended to every script that needs them. KEYS: d, s, g, x, q. The hot loops
# (a push batch, a large key group) avoid parsing what they already know: a call into Redis or
# a struct call per packet is what a script's time goes to.
_HELPERS = r"""
-- The double 0.0 (no struct or string library while Redis loads a library: a literal).
local NEVER = '\0\0\0\0\0\0\0\0'
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), t
end
-- Redis's clock in ms with its microseconds: due times (decision 21) are exact to them.
local function now_precise()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000, t
end
local function digits(n) return string.format('%016.0f', n) end
-- Tables made at a library's first call (no string library while Redis loads one) and kept:
-- CHAR[b] the byte b as a string, LAST3[i] i in three digits, LEN2[n] n as a u16. A string
-- function a packet (a ``string.format``, a ``struct.pack``) costs more than a table lookup.
local CHAR, LAST3, LEN2
local function tables()
  if CHAR then return end
  CHAR, LAST3, LEN2 = {}, {}, {}
  for i = 0, 255 do CHAR[i] = string.char(i) end
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
-- The next sequence number of the queue whose ``:q`` is ``last_key``, from Redis's clock
-- (``t``, as TIME gives it): push order within the queue, clock order across queues.
local function next_seq(last_key, t)
  local seq = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = tonumber(redis.call('GET', last_key) or '0')
  if seq <= last then seq = last + 1 end
  return seq
end
-- The length of a record's key (two bytes read as numbers: no ``struct`` call, no substring).
local function key_length(rec)
  local high, low = string.byte(rec, 10, 11)
  return high * 256 + low
end
local function unpack_packet(rec)
  local prio = string.byte(rec, 1)
  local deadline = struct.unpack('>d', string.sub(rec, 2, 9))
  local klen = key_length(rec)
  return prio, deadline, string.sub(rec, 12, 11 + klen), string.sub(rec, 12 + klen)
end
local function record(prio, deadline, prefix, payload)
  local packed = NEVER
  if deadline > 0 then packed = struct.pack('>d', deadline) end
  return CHAR[prio] .. packed .. prefix .. payload
end
-- One command with many arguments, in slices that stay within Lua's stack.
local function bulk(command, key, args)
  for i = 1, #args, 1000 do
    redis.call(command, key, unpack(args, i, math.min(i + 999, #args)))
  end
end
local function group_prefix(key)
  local n = #key
  local length = LEN2[n]
  if not length then
    length = CHAR[math.floor(n / 256)] .. CHAR[n % 256]
    LEN2[n] = length
  end
  return length .. key
end
-- The key index, KEYS[KI] (``:k``; a lease function's dead queue has its own at KI + 1): key
-- -> the seq of its one packet, or '#' .. n when the key has n packets, all of them in the
-- group index (``:g``). A key with one packet, the common case, has no group index entry: a
-- push of it writes a hash field instead of a sorted-set member, and a pop of it reads no
-- range. ``entries`` below are {key, group prefix, seq} a packet.
local KI = 0
local function hmget(hash, fields)
  local out = {}
  for i = 1, #fields, 1000 do
    local last = math.min(i + 999, #fields)
    local part = redis.call('HMGET', hash, unpack(fields, i, last))
    for j = i, last do out[j] = part[j - i + 1] end
  end
  return out
end
local function grouped(v) return v and string.byte(v, 1) == 35 end  -- '#'
-- The index value of each distinct key of ``entries`` (false: none), and those keys. ``known``
-- (optional): values this call already read (key -> value or false), not read again.
local function states_of(index, entries, known)
  local keys, state, missing = {}, {}, {}
  for _, e in ipairs(entries) do
    local key = e[1]
    if state[key] == nil then
      local v = known and known[key]
      if v == nil then
        v = false
        missing[#missing + 1] = key
      end
      state[key] = v
      keys[#keys + 1] = key
    end
  end
  if #missing > 0 then
    local values = hmget(index, missing)
    for j, key in ipairs(missing) do state[key] = values[j] or false end
  end
  return state, keys
end
-- Index packets entering the queue (pushed, or put back under their old seq).
local function index_insert(index, groups, entries)
  if #entries == 0 then return end
  local state, keys = states_of(index, entries)
  local members = {}
  for _, e in ipairs(entries) do
    local key, v = e[1], state[e[1]]
    if not v then
      state[key] = e[3]
    else
      if grouped(v) then
        state[key] = '#' .. (tonumber(string.sub(v, 2)) + 1)
      else  -- the key's second packet: both join the group index
        state[key] = '#2'
        members[#members + 1] = 0
        members[#members + 1] = e[2] .. v
      end
      members[#members + 1] = 0
      members[#members + 1] = e[2] .. e[3]
    end
  end
  local fields = {}
  for _, key in ipairs(keys) do
    fields[#fields + 1] = key
    fields[#fields + 1] = state[key]
  end
  bulk('HSET', index, fields)
  bulk('ZADD', groups, members)
end
-- Filing packets that enter a queue (pushed, promoted, moved in, put back): ``filing()``
-- gathers one command's arguments a structure, ``file_packet`` adds a packet (its seq, record,
-- key, group prefix, prio and TTL deadline), ``filed`` writes them into the queue whose ``:d``
-- ``:s`` ``:g`` ``:x`` ``:k`` are given, and says whether a selectable packet entered (then
-- waiting front ends are owed a message).
local function filing() return {data = {}, entries = {}, levels = {}, deadlines = {}} end
local function file_packet(f, seq, rec, key, prefix, prio, deadline)
  local data, levels, deadlines = f.data, f.levels, f.deadlines
  data[#data + 1] = seq
  data[#data + 1] = rec
  f.entries[#f.entries + 1] = {key, prefix, seq}
  if prio > 0 then
    levels[#levels + 1] = -prio
    levels[#levels + 1] = seq
  end
  if deadline > 0 then
    deadlines[#deadlines + 1] = deadline
    deadlines[#deadlines + 1] = seq
  end
end
local function filed(f, d, s, g, x, k)
  bulk('HSET', d, f.data)
  index_insert(k, g, f.entries)
  bulk('ZADD', s, f.levels)
  bulk('ZADD', x, f.deadlines)
  return #f.levels > 0
end
-- Unindex packets leaving the queue (``known``: as ``states_of``).
local function index_remove(index, groups, entries, known)
  if #entries == 0 then return end
  local state, keys = states_of(index, entries, known)
  local members, gone, left = {}, {}, {}
  for _, e in ipairs(entries) do
    local v = state[e[1]]
    if grouped(v) then
      members[#members + 1] = (e[2] or group_prefix(e[1])) .. e[3]
      state[e[1]] = '#' .. (tonumber(string.sub(v, 2)) - 1)
    else
      state[e[1]] = false
    end
  end
  for _, key in ipairs(keys) do
    local v = state[key]
    if v and v ~= '#0' then
      left[#left + 1] = key
      left[#left + 1] = v
    else
      gone[#gone + 1] = key
    end
  end
  bulk('HDEL', index, gone)
  bulk('HSET', index, left)
  bulk('ZREM', groups, members)
end
-- The seqs of ``key``'s packets in push order (at most ``limit``), from the group index; none
-- (an empty list) for a key with one packet.
local function group_of(index, groups, key, prefix, limit)
  if not grouped(redis.call('HGET', index, key)) then return {} end
  local members = redis.call('ZRANGEBYLEX', groups, '[' .. prefix, '[' .. prefix .. '\255',
    'LIMIT', 0, limit)
  local seqs = {}
  for i, member in ipairs(members) do seqs[i] = string.sub(member, #prefix + 1) end
  return seqs
end
-- Remove live packets (by seq) from every structure. ``key``: their key, when they are one
-- key group (else each record is parsed for it). ``full``: return five fields a packet (key,
-- payload, prio, seq, deadline: enough to put it back), else two (key, payload).
local function remove_all(seqs, key, full)
  local out, entries, levels = {}, {}, {}
  if #seqs == 0 then return out end
  local prefix = key and group_prefix(key)
  for i = 1, #seqs, 1000 do
    local recs = redis.call('HMGET', KEYS[1], unpack(seqs, i, math.min(i + 999, #seqs)))
    for j, rec in ipairs(recs) do
      local seq = seqs[i + j - 1]
      local prio, k, payload = string.byte(rec, 1), key, nil
      if key then
        payload = string.sub(rec, 12 + #key)
      else
        local _p, _d
        _p, _d, k, payload = unpack_packet(rec)
      end
      local n = #out
      out[n + 1], out[n + 2] = k, payload
      if full then
        local deadline = struct.unpack('>d', string.sub(rec, 2, 9))
        out[n + 3], out[n + 4], out[n + 5] = prio, seq, tostring(deadline)
      end
      entries[#entries + 1] = {k, prefix or group_prefix(k), seq}
      if prio > 0 then levels[#levels + 1] = seq end
    end
  end
  bulk('HDEL', KEYS[1], seqs)
  index_remove(KEYS[KI], KEYS[3], entries)
  bulk('ZREM', KEYS[2], levels)
  if redis.call('EXISTS', KEYS[4]) == 1 then bulk('ZREM', KEYS[4], seqs) end
  return out
end
-- Remove the packets whose deadline has come; returns how many.
local function sweep(now)
  local due = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
  remove_all(due, nil, false)
  return #due
end
-- Delayed packets (decision 21) wait in KEYS[YI] (``:y``: seq -> the packet's record, its TTL
-- deadline already its due time plus its TTL) and KEYS[YI + 1] (``:Y``: seq by due time, ms
-- on Redis's clock with microseconds); KEYS[YI + 2] is the queue's waiting mark (``:w``). Until
-- due a packet is in no other structure: not selectable, in no key group, no TTL deadline.
-- YI 0: the function takes none of these keys.
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
      file_packet(f, due[i], rec, string.sub(rec, 12, 11 + klen), string.sub(rec, 10, 11 + klen),
        string.byte(rec, 1), deadline)
    end
  end
  bulk('HDEL', KEYS[YI], due)
  redis.call('ZREMRANGEBYSCORE', KEYS[YI + 1], '-inf', now)
  if filed(f, KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[KI])
      and redis.call('EXISTS', KEYS[YI + 2]) == 1 then
    redis.call('PUBLISH', channel_of(KEYS[YI + 2]), '')
  end
  return #f.entries, #due - #f.entries
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
-- Once the queue holds nothing, forget it entirely (decision 5), but for the last sequence
-- number while ``seqs_held``.
local function forget_if_empty()
  if redis.call('EXISTS', KEYS[1]) == 0 then
    if seqs_held() then
      redis.call('DEL', KEYS[KI])
    else
      redis.call('DEL', KEYS[5], KEYS[KI])
    end
  end
end
-- The earliest due time of the queue's delayed packets, 0 for none.
local function next_due()
  local head = redis.call('ZRANGE', KEYS[YI + 1], 0, 0, 'WITHSCORES')
  return tonumber(head[2] or '0')
end
"""

#: KEYS d s g x q w k; ARGV channel, then four fields a packet: key payload ttl_ms prio. Pushes
#: them in order (a batch's consecutive pushes to one queue are one call: each is still whole,
#: and no other script runs between them). Returns the earliest deadline in ms (0 for none) and
#: the packets the queue holds. No
#: ``allow-oom``: Redis refuses it while over ``maxmemory``, before it runs.
PUSH = r"""
local now, t = now_ms()
local seq = next_seq(KEYS[5], t)
local f, earliest, s, head = filing(), 0, nil, nil
for i = 2, #ARGV, 4 do
  local key, payload, ttl, prio = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local deadline = 0
  if ttl > 0 then
    deadline = now + ttl
    if earliest == 0 or deadline < earliest then earliest = deadline end
  end
  local prefix = group_prefix(key)
  s, head = seq_digits(seq, head)
  file_packet(f, s, record(prio, deadline, prefix, payload), key, prefix, prio, deadline)
  seq = seq + 1
end
local selectable = filed(f, KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[KI])
redis.call('SET', KEYS[5], digits(seq - 1))
if selectable and redis.call('EXISTS', KEYS[6]) == 1 then redis.call('PUBLISH', ARGV[1], '') end
-- And how many packets the queue holds now, for the front end's figures.
return {earliest, redis.call('HLEN', KEYS[1])}
"""

#: KEYS q y Y w; ARGV five fields a packet: key payload ttl_ms prio delay_ms (delay > 0). Holds
#: delayed pushes (decision 21) in order: each takes its seq (its place in push order) now, its
#: due time is Redis's clock plus its delay, its TTL deadline its due time plus its TTL. When
#: some front end waits on the queue, publishes its channel with the earliest due time (ms), so
#: that front end times the promotion too (the pusher may die first). Returns that earliest due
#: time and how many delayed packets the queue holds. No ``allow-oom``, as ``push``.
PUSH_DELAYED = r"""
YI = 2
local now, t = now_precise()
local seq = next_seq(KEYS[1], t)
local data, dues, earliest, s, head = {}, {}, 0, nil, nil
for i = 1, #ARGV, 5 do
  local key, payload, ttl, prio = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local due = now + tonumber(ARGV[i + 4])
  local deadline = 0
  if ttl > 0 then deadline = due + ttl end
  s, head = seq_digits(seq, head)
  data[#data + 1] = s
  data[#data + 1] = record(prio, deadline, group_prefix(key), payload)
  dues[#dues + 1] = due
  dues[#dues + 1] = s
  if earliest == 0 or due < earliest then earliest = due end
  seq = seq + 1
end
bulk('HSET', KEYS[2], data)
bulk('ZADD', KEYS[3], dues)
redis.call('SET', KEYS[1], digits(seq - 1))
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('PUBLISH', channel_of(KEYS[4]), string.format('%.3f', earliest))
end
return {tostring(earliest), redis.call('HLEN', KEYS[2])}
"""

#: KEYS d s g x q r y Y w l k; ARGV max_pop, pops, full, call id, retry ('1' if sent before), then
#: the call ids whose results the front end has. Promotes and sweeps what is due, then ``pops``
#: times removes the best packet and its key group (decisions 2-4). Returns one flat list a
#: pop: two fields a packet (key, payload), or with ``full`` = 1 five (key, payload, prio, seq,
#: deadline: enough for a delivery nobody could take to go back unchanged); then the
#: selectable packets left (with ``full`` only; else 0), and all the packets left. A call that
#: took packets keeps that reply
#: under its id in ``:r``.
#: ``allow-oom``: a pop only frees memory, and a full Redis must still drain.
POP = r"""
local max_pop, pops, full = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3] == '1'
local call_id, retry = ARGV[4], ARGV[5] == '1'
-- Results the front end has confirmed it holds: no longer kept.
if #ARGV > 5 then redis.call('HDEL', KEYS[6], unpack(ARGV, 6)) end
-- A call sent again (its reply was lost: Redis restarted, the connection broke) answers with
-- what it took the first time, if it ran then: so no packet is removed for nobody.
if retry then
  local kept = redis.call('HGET', KEYS[6], call_id)
  if kept then return cmsgpack.unpack(kept) end
end
YI, LI = 7, 10
local expiring, _, expired = sweep_due()
-- Removals wait until every pop of the call has chosen (one HDEL and one ZREM a structure
-- for the whole call, not per pop); meanwhile ``taken`` keeps a packet from being chosen
-- twice, and the selection set is read in pages of candidates, best first.
local taken, seqs, entries = {}, {}, {}
local taken_by_group = {}  -- key -> packets of it taken (for groups over max_pop)
-- ``known``: the key index's value of every key read so far (all read before any removal).
local page, records, page_keys, at, start, known = {}, {}, {}, 1, 0, {}
-- ``prefix``: the key's group prefix where it has a group (nil: ``index_remove`` needs none).
local function take(seq, key, prefix)
  taken[seq] = true
  seqs[#seqs + 1] = seq
  entries[#entries + 1] = {key, prefix, seq}
  taken_by_group[key] = (taken_by_group[key] or 0) + 1
end
-- The best packet not yet taken: its seq, record and key, and whether its key has a group; or
-- nil.
local function best(wanted)
  while true do
    if at > #page then
      page = redis.call('ZRANGE', KEYS[2], start, start + math.min(wanted, 1000) - 1, 'REV')
      if #page == 0 then return nil end
      start, at = start + #page, 1
      records = redis.call('HMGET', KEYS[1], unpack(page))
      local page_entries = {}
      for i, rec in ipairs(records) do
        page_keys[i] = string.sub(rec, 12, 11 + key_length(rec))
        page_entries[i] = {page_keys[i]}
      end
      for key, v in pairs(states_of(KEYS[KI], page_entries, known)) do known[key] = v end
    end
    local seq, rec, key = page[at], records[at], page_keys[at]
    at = at + 1
    if not taken[seq] then return seq, rec, key, grouped(known[key]) end
  end
end
-- Add the packet ``seq`` (its record, its key) to a pop's reply.
local function packet(out, seq, rec, key)
  local n = #out
  out[n + 1], out[n + 2] = key, string.sub(rec, 12 + #key)
  if full then
    out[n + 3], out[n + 4] = string.byte(rec, 1), seq
    out[n + 5] = tostring(struct.unpack('>d', string.sub(rec, 2, 9)))
  end
end
local function pop_one(left)
  local selected, rec, key, has_group = best(left)
  if not selected then return {} end
  local out = {}
  packet(out, selected, rec, key)
  local prefix = has_group and group_prefix(key) or nil
  local before = taken_by_group[key] or 0
  take(selected, key, prefix)
  if not has_group then return out end
  -- The rest of its key group in push order; packets taken by earlier pops of this call are
  -- still in the index, so the range reaches past them.
  local range = redis.call('ZRANGEBYLEX', KEYS[3], '[' .. prefix, '[' .. prefix .. '\255',
    'LIMIT', 0, max_pop + before)
  local others, skip = {}, #prefix + 1
  for _, member in ipairs(range) do
    if #others + 1 >= max_pop then break end
    local seq = string.sub(member, skip)
    if not taken[seq] then
      others[#others + 1] = seq
      take(seq, key, prefix)
    end
  end
  for i = 1, #others, 1000 do
    local recs = redis.call('HMGET', KEYS[1], unpack(others, i, math.min(i + 999, #others)))
    for j, r in ipairs(recs) do packet(out, others[i + j - 1], r, key) end
  end
  return out
end
local replies = {}
for i = 1, pops do replies[i] = pop_one(pops - i + 1) end
bulk('HDEL', KEYS[1], seqs)
index_remove(KEYS[KI], KEYS[3], entries, known)
bulk('ZREM', KEYS[2], seqs)  -- prio-0 seqs among them are simply not members
if expiring then bulk('ZREM', KEYS[4], seqs) end
-- Last, the packets held (for the front end's figures) and, for a delivery, how many
-- selectable ones are left (a subscriber's front end stops there; 0 otherwise: unread).
local held = redis.call('HLEN', KEYS[1])
-- A queue this call emptied is forgotten. One that was empty already was forgotten when it
-- emptied (or keeps its number for its delayed or leased packets): a pop of an empty or
-- missing queue, a consumer polling, costs three calls (EXISTS, ZRANGE, HLEN), not six.
if held == 0 and (#seqs > 0 or expired > 0) then forget_if_empty() end
replies[pops + 1] = full and redis.call('ZCARD', KEYS[2]) or 0
replies[pops + 2] = held
if #seqs > 0 then
  -- Kept until the front end confirms it has the reply (a later call's ARGV, or its cleanup
  -- every few seconds); the key's day-long lifetime only bounds what a front end that died
  -- leaves behind, far beyond any restart of Redis.
  redis.call('HSET', KEYS[6], call_id, cmsgpack.pack(replies))
  redis.call('PEXPIRE', KEYS[6], 86400000)
end
return replies
"""

#: KEYS d s g x q y Y w l k; no ARGV. Promotes and sweeps what is due and returns the rank of what a
#: pop would select: {prio, seq}, or {} if nothing is selectable.
RANK = r"""
YI, LI = 6, 9
sweep_due()
forget_if_empty()
local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
if #top == 0 then return {} end
return {-tonumber(top[2]), top[1]}
"""

#: KEYS d s g x q y Y w l k; no ARGV. Moves the delayed packets that are due into the queue and
#: removes the packets whose deadline has come. Returns {how many expired, how many entered,
#: the next due time in ms or 0, how many packets the queue holds}.
SWEEP = r"""
YI, LI = 6, 9
local _, entered, expired = sweep_due()
forget_if_empty()
return {expired, entered, tostring(next_due()), redis.call('HLEN', KEYS[1])}
"""

#: KEYS d s g x q y Y l k; no ARGV. Removes every packet (prio 0 and delayed ones included; leased
#: ones are not in the queue, and keep the last sequence number: ``seqs_held``); returns {how
#: many queued, how many delayed}.
PURGE = r"""
LI = 8
local n, delayed = redis.call('HLEN', KEYS[1]), redis.call('HLEN', KEYS[6])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6], KEYS[7], KEYS[KI])
if not seqs_held() then redis.call('DEL', KEYS[5]) end
return {n, delayed}
"""

#: KEYS d s g x q w k; ARGV channel, then five fields a packet as POP returns them with ``full``.
#: Puts packets back as they were (prio, place in push order, deadline); drops those whose TTL
#: has passed. Returns how many went back. ``allow-oom``: the memory was held a moment ago.
RESTORE = r"""
local now = now_ms()
local f, last = filing(), tonumber(redis.call('GET', KEYS[5]) or '0')
for i = 2, #ARGV, 5 do
  local key, payload, prio = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local s, deadline = ARGV[i + 3], tonumber(ARGV[i + 4])
  if deadline == 0 or deadline > now then
    local prefix = group_prefix(key)
    file_packet(f, s, record(prio, deadline, prefix, payload), key, prefix, prio, deadline)
    if tonumber(s) > last then last = tonumber(s) end
  end
end
local selectable = filed(f, KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[KI])
if #f.entries > 0 then redis.call('SET', KEYS[5], digits(last)) end
if selectable and redis.call('EXISTS', KEYS[6]) == 1 then redis.call('PUBLISH', ARGV[1], '') end
return #f.entries
"""

#: KEYS d s g x k; ARGV count max_pop. What the next pops would return, in order, removing
#: nothing (and sweeping nothing: it skips expired packets). Flat list: key, payload, prio.
PEEK = r"""
local count, max_pop = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local taken, out, found = {}, {}, 0
local function live(deadline) return deadline == 0 or deadline > now end
local start = 0
while found < count do
  local page = redis.call('ZRANGE', KEYS[2], start, start + 99, 'REV')
  if #page == 0 then break end
  start = start + 100
  for _, seq in ipairs(page) do
    local prio, deadline, key, payload = unpack_packet(redis.call('HGET', KEYS[1], seq))
    if not taken[seq] and live(deadline) then
      local in_reply = 1
      taken[seq] = true
      out[#out + 1] = key; out[#out + 1] = payload; out[#out + 1] = prio
      found = found + 1
      local others = group_of(KEYS[KI], KEYS[3], key, group_prefix(key), -1)
      for _, other in ipairs(others) do
        if found >= count or in_reply >= max_pop then break end
        if not taken[other] then
          local p, d, k, v = unpack_packet(redis.call('HGET', KEYS[1], other))
          if live(d) then
            taken[other] = true
            in_reply = in_reply + 1
            out[#out + 1] = k; out[#out + 1] = v; out[#out + 1] = p
            found = found + 1
          end
        end
      end
    end
    if found >= count then break end
  end
end
return out
"""


# -- move (decision 22) -----------------------------------------------------------------------

_MOVE_HELPERS = r"""
-- Packets a round of a cross-slot move of all takes (whole groups, so it may take more).
local MOVE_ROUND = 10000
-- The seqs of the queue's packets a move of at most ``limit`` packets takes (0: every queued
-- one), in push order: whole key groups, chosen in pop order (best selectable packet first),
-- while fewer than ``limit`` have been taken; so prio-0 packets whose key has no selectable
-- packet move only when ``limit`` is 0.
local function move_selection(limit)
  if limit == 0 then
    local all = redis.call('HKEYS', KEYS[1])
    table.sort(all)
    return all
  end
  local seqs, taken, start = {}, {}, 0
  while #seqs < limit do
    local page = redis.call('ZRANGE', KEYS[2], start, start + 99, 'REV')
    if #page == 0 then break end
    start = start + #page
    local recs = redis.call('HMGET', KEYS[1], unpack(page))
    for i, seq in ipairs(page) do
      if #seqs >= limit then break end
      if not taken[seq] then
        local klen = key_length(recs[i])
        local key = string.sub(recs[i], 12, 11 + klen)
        local group = group_of(KEYS[KI], KEYS[3], key, group_prefix(key), -1)
        if #group == 0 then group = {seq} end
        for _, member in ipairs(group) do
          taken[member] = true
          seqs[#seqs + 1] = member
        end
      end
    end
  end
  table.sort(seqs)  -- fixed-width digits: string order is push order
  return seqs
end
-- Take ``seqs`` out of the queue (KEYS d s g x, k at KI, attempt counts at ``attempts``) for a
-- move: five fields a packet, as ``remove_all`` gives them; their attempt counts are dropped
-- (decision 22: they start again).
local function take_for_move(seqs, attempts)
  local packets = remove_all(seqs, nil, true)
  if #seqs > 0 and redis.call('EXISTS', attempts) == 1 then bulk('HDEL', attempts, seqs) end
  forget_if_empty()
  return packets
end
-- Push moved packets (five fields each, from ``o`` in ``t``) into the queue whose keys are
-- ``tk`` = {d, s, g, x, q, w, k} as pushes made now, in their order, each keeping its prio and
-- TTL deadline; a packet whose deadline passed meanwhile is dropped. Returns how many entered
-- and the earliest deadline (0 for none).
local function push_moved(tk, t, o)
  local now, clock = now_precise()
  local seq = next_seq(tk[5], clock)
  local f, earliest, s, head = filing(), 0, nil, nil
  for i = o, #t, 5 do
    local key, payload, prio, deadline = t[i], t[i + 1], tonumber(t[i + 2]), tonumber(t[i + 4])
    if deadline == 0 or deadline > now then
      local prefix = group_prefix(key)
      s, head = seq_digits(seq, head)
      file_packet(f, s, record(prio, deadline, prefix, payload), key, prefix, prio, deadline)
      seq = seq + 1
      if deadline > 0 and (earliest == 0 or deadline < earliest) then earliest = deadline end
    end
  end
  if #f.entries == 0 then return 0, 0 end
  local selectable = filed(f, tk[1], tk[2], tk[3], tk[4], tk[7])
  redis.call('SET', tk[5], digits(seq - 1))
  if selectable and redis.call('EXISTS', tk[6]) == 1 then
    redis.call('PUBLISH', channel_of(tk[6]), '')
  end
  return #f.entries, earliest
end
"""

#: KEYS: the source's d s g x q r y Y w l k a, then the target's d s g x q w k (one Cluster slot);
#: ARGV limit (0: all). Moves whole key groups, in pop order, while fewer than ``limit`` packets
#: have moved (decision 22): due delayed packets are promoted and expired ones swept first;
#: leased and delayed packets stay. Returns {how many moved, how many entered (fewer when a
#: TTL passed meanwhile), the earliest TTL deadline among them (0: none), packets left in the
#: source, packets in the target}.
MOVE = r"""
KI, YI, LI = 11, 7, 10
sweep_due()
local seqs = move_selection(tonumber(ARGV[1]))
local packets = take_for_move(seqs, KEYS[12])
local entered, earliest = push_moved({unpack(KEYS, 13, 19)}, packets, 1)
local left, held = redis.call('HLEN', KEYS[1]), redis.call('HLEN', KEYS[13])
return {#seqs, entered, tostring(earliest), left, held}
"""

#: KEYS: the source's d s g x q r y Y w l k a m; ARGV limit, move id, the target's name. The first
#: half of a move between two Cluster slots: takes what a move of ``limit`` would take (0: a
#: round of whole groups of about ``MOVE_ROUND`` packets, then, once nothing selectable is left,
#: every prio-0 packet left) and keeps it in ``:m`` under the move id (with Redis's time and the
#: target's name) until ``move_in`` has put it into the target and the front end deletes it; a
#: front end that dies between the two leaves it there for any front end's scan to finish.
#: Returns the packets in push order, five fields each (none: nothing to move).
MOVE_OUT = r"""
KI, YI, LI = 11, 7, 10
sweep_due()
local limit = tonumber(ARGV[1])
local seqs = move_selection(limit > 0 and limit or MOVE_ROUND)
if #seqs == 0 and limit == 0 then seqs = move_selection(0) end
local packets = take_for_move(seqs, KEYS[12])
if #packets > 0 then
  local kept = {now_ms(), ARGV[3]}
  for _, v in ipairs(packets) do kept[#kept + 1] = v end
  redis.call('HSET', KEYS[13], ARGV[2], cmsgpack.pack(kept))
end
return packets
"""

#: KEYS: the target's d s g x q w k M; ARGV move id, then five fields a packet as ``move_out``
#: gave them. The second half: pushes the group into the target as ``move`` does, once per move
#: id (``:M`` remembers the ids it applied for a day, so a call sent again, or a scan finishing
#: a dead front end's move, applies it once). Returns how many entered. No ``allow-oom``.
MOVE_IN = r"""
if redis.call('SISMEMBER', KEYS[8], ARGV[1]) == 1 then return 0 end
local entered = push_moved({unpack(KEYS, 1, 7)}, ARGV, 2)
redis.call('SADD', KEYS[8], ARGV[1])
redis.call('PEXPIRE', KEYS[8], 86400000)
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
# Every lease function takes twenty KEYS: the queue's d s g x q w, its l (hash: handle -> the
# lease, cmsgpack {attempt, then six fields a packet: key payload prio seq deadline count}), L
# (sorted set: handle by deadline in ms, or by the end of a release delay) and a (hash: seq ->
# how many leases of the packet ended other than by ack; absent for none); then its dead-letter
# queue's d s g x q w (one slot: keys.py); then the queue's key index k and its dead queue's;
# then the queue's delayed packets y, their due times Y and its waiting mark w again.
# ARGV starts with the queue's channel, the dead queue's
# channel, max deliveries (0: never) and '1' if the dead queue may be used ('0': its name would
# be too long, so a group due there is dropped). A lease lives exactly while ``:l`` holds it.
_LEASE_HELPERS = r"""
local max_deliveries, dead_ok
-- Every lease function starts here: ARGV 3 and 4 are the same for all of them.
local function lease_args()
  max_deliveries, dead_ok = tonumber(ARGV[3]), ARGV[4] == '1'
  KI = 16  -- the queue's key index; its dead queue's is KEYS[17]
  YI = 18  -- the queue's delayed packets, their due times, its waiting mark
  LI = 7  -- its lease table
end
-- Put a lease's packets into the queue at KEYS offset ``o`` (0: the queue, 9: its dead
-- queue) as they were; drops those whose TTL passed (TTL wins). ``bump``: each packet's count
-- one more (nil: counts reset, for the dead queue). Returns how many went back.
local function put_back(o, channel, t, bump, now)
  local f, counts = filing(), {}
  local last = tonumber(redis.call('GET', KEYS[o + 5]) or '0')
  for i = 2, #t, 6 do
    local key, payload, prio = t[i], t[i + 1], t[i + 2]
    local s, deadline, count = t[i + 3], t[i + 4], t[i + 5]
    if deadline == 0 or deadline > now then
      local prefix = group_prefix(key)
      file_packet(f, s, record(prio, deadline, prefix, payload), key, prefix, prio, deadline)
      if o == 0 and count + bump > 0 then
        counts[#counts + 1] = s
        counts[#counts + 1] = count + bump
      end
      if tonumber(s) > last then last = tonumber(s) end
    end
  end
  local index = KI
  if o > 0 then index = KI + 1 end
  local selectable = filed(f, KEYS[o + 1], KEYS[o + 2], KEYS[o + 3], KEYS[o + 4], KEYS[index])
  bulk('HSET', KEYS[9], counts)
  if #f.entries > 0 then redis.call('SET', KEYS[o + 5], digits(last)) end
  if selectable and redis.call('EXISTS', KEYS[o + 6]) == 1 then
    redis.call('PUBLISH', channel, '')
  end
  return #f.entries
end
-- End a lease other than by ack: its packets go back, counted (``counted`` false: a delivery
-- nobody could take, not an attempt), or after max deliveries to the dead queue.
-- Returns {back, dead, dropped}.
local function end_lease(handle, counted, now)
  local rec = redis.call('HGET', KEYS[7], handle)
  redis.call('HDEL', KEYS[7], handle)
  redis.call('ZREM', KEYS[8], handle)
  if not rec then return {0, 0, 0} end
  local t = cmsgpack.unpack(rec)
  if counted and max_deliveries > 0 and t[1] >= max_deliveries then
    if dead_ok then return {0, put_back(9, ARGV[2], t, nil, now), 0} end
    return {0, 0, (#t - 1) / 6}
  end
  local bump = 0
  if counted then bump = 1 end
  return {put_back(0, ARGV[1], t, bump, now), 0, 0}
end
-- End every lease of the queue whose deadline (or release delay) has come.
local function sweep_leases(now)
  local totals = {0, 0, 0}
  local due = redis.call('ZRANGEBYSCORE', KEYS[8], '-inf', now)
  for _, handle in ipairs(due) do
    local r = end_lease(handle, true, now)
    for i = 1, 3 do totals[i] = totals[i] + r[i] end
  end
  return totals, due
end
-- Once neither the queue nor a lease holds a packet, forget it entirely (decision 5).
local function forget_all_if_empty()
  if redis.call('EXISTS', KEYS[1]) == 0 then
    forget_if_empty()
    if redis.call('EXISTS', KEYS[7]) == 0 then redis.call('DEL', KEYS[9]) end
  end
end
"""

#: 20 KEYS, ARGV as above, then max_pop, handle, lease_ms. Ends the queue's due leases and
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
local _, _, key = unpack_packet(redis.call('HGET', KEYS[1], selected))
local seqs = {selected}
for _, seq in ipairs(group_of(KEYS[KI], KEYS[3], key, group_prefix(key), max_pop)) do
  if #seqs >= max_pop then break end
  if seq ~= selected then seqs[#seqs + 1] = seq end
end
local counts = {}
if redis.call('EXISTS', KEYS[9]) == 1 then
  for i = 1, #seqs, 1000 do
    local part = redis.call('HMGET', KEYS[9], unpack(seqs, i, math.min(i + 999, #seqs)))
    for j, c in ipairs(part) do counts[i + j - 1] = c end
  end
  bulk('HDEL', KEYS[9], seqs)
end
local packets = remove_all(seqs, key, true)
local t, out, most = {0}, {}, 0
for j = 1, #seqs do
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
redis.call('HSET', KEYS[7], handle, cmsgpack.pack(t))
redis.call('ZADD', KEYS[8], due, handle)
forget_all_if_empty()
local reply = {t[1], due, redis.call('ZCARD', KEYS[2])}
for _, v in ipairs(out) do reply[#reply + 1] = v end
return reply
"""

#: 20 KEYS, ARGV as above, then op, handle, ms. What an ack ('ack'), release ('release', ms the
#: delay), touch ('touch', ms the new lease time) or a delivery nobody could take ('unreserve')
#: does to a lease. A lease whose deadline has passed is ended here (its packets go back) and
#: answers as not live. Returns {live (1/0), back, dead, dropped, the lease's new due ms or 0}.
LEASE_OP = r"""
lease_args()
local op, handle, ms = ARGV[5], ARGV[6], tonumber(ARGV[7])
local now = now_ms()
local due = redis.call('ZSCORE', KEYS[8], handle)
if not due then return {0, 0, 0, 0, 0} end
if tonumber(due) <= now then
  local r = end_lease(handle, true, now)
  forget_all_if_empty()
  return {0, r[1], r[2], r[3], 0}
end
local r, new_due = {0, 0, 0}, 0
if op == 'ack' then
  redis.call('HDEL', KEYS[7], handle)
  redis.call('ZREM', KEYS[8], handle)
elseif op == 'unreserve' then
  r = end_lease(handle, false, now)
elseif op == 'release' and ms == 0 then
  r = end_lease(handle, true, now)
else  -- touch, or a release with a delay: the lease ends (or its packets go back) at new_due
  new_due = now + ms
  redis.call('ZADD', KEYS[8], new_due, handle)
end
forget_all_if_empty()
return {1, r[1], r[2], r[3], new_due}
"""

#: 20 KEYS, ARGV as above. Ends every lease of the queue whose deadline or release delay has
#: come. Returns {back, dead, dropped, the next due ms or 0, then the handles ended}.
LEASE_SWEEP = r"""
lease_args()
local totals, ended = sweep_leases(now_ms())
forget_all_if_empty()
local next_due = redis.call('ZRANGE', KEYS[8], 0, 0, 'WITHSCORES')
local reply = {totals[1], totals[2], totals[3], tonumber(next_due[2] or '0')}
for _, handle in ipairs(ended) do reply[#reply + 1] = handle end
return reply
"""


# -- the library ------------------------------------------------------------------------------

#: The layout of the keys and the calling convention of the functions. A front end loads the
#: library ``pinpriq_<LAYOUT>`` once (``FUNCTION LOAD``); Redis keeps it (in its RDB and AOF
#: too) and every front end calls the same functions. Bump it with any change to the scripts.
LAYOUT = 4
LIBRARY_NAME = f"pinpriq_{LAYOUT}"

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


def function_name(operation: str) -> str:
    """What ``FCALL`` names for one operation of this layout."""
    return f"{LIBRARY_NAME}_{operation}"


def _register(operation: str, body: str, flags: str) -> str:
    return (
        f"local function op_{operation}()\n{body}end\n"
        f"redis.register_function{{function_name='{function_name(operation)}', "
        "callback=function(keys, args) KEYS, ARGV, KI, YI, LI = keys, args, #keys, 0, 0; tables(); "
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
    + _MOVE_HELPERS
    + _LEASE_HELPERS
    + "".join(_register(op, body, flags) for op, (body, flags) in _FUNCTIONS.items())
)
