"""The Lua scripts of the Redis backend (redis.py), run by the Redis server on behalf of the daemon
and router processes that call it.

Every read is bounded inside the server: a value's length is checked (STRLEN / HSTRLEN) before it is
read, so an oversized record never leaves Redis; a key's TYPE is checked before it is used, so one
planted with another type is skipped (or, in our own namespace, overwritten) instead of failing the
script for everyone; listings page with ZSCAN, never one unpack of the whole index. Readers report
what they skipped with a one-letter code, for redis.py to count:
  V: the value follows   L: over the size cap   N: no TTL (kvd never writes one)
  T: another type        P: not a node key of this cluster (an index member planted by hand)
A listing page reads its readable node keys with one MGET (a page of them, at most LIST_PAGE).
"""
from __future__ import annotations

# Every script that changes the node listing bumps its version key, so that watchers need not read the
# listing to learn that it did not change. A missing (or planted, non-numeric) version starts at a
# random base (the last ARGV), so that a wiped server never repeats a version a watcher saw before.
_BUMP = """
local function bump(key, base)
  local n = redis.pcall('INCR', key)
  if type(n) ~= 'number' or n == 1 then redis.call('SET', key, base) end
end
local function now_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
local function index_ok(key)  -- the nodes index of another type (planted) would fail every ZADD
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'zset' and t ~= 'none' then redis.call('DEL', key) end
end
"""
# a node key's state for a reader: its code (see the module docstring; '' = absent), and the value
_READ_NODE = """
local function node_state(key, max)
  local t = redis.call('TYPE', key)['ok']
  if t == 'none' then return '' end
  if t ~= 'string' then return 'T' end
  if redis.call('STRLEN', key) > max then return 'L' end
  if redis.call('PTTL', key) < 0 then return 'N' end
  return 'V'
end
local function read_node(key, max)
  local code = node_state(key, max)
  if code == 'V' then return code, redis.call('GET', key) end
  return code, ''
end
"""
# Is the node key held by a live record of another incarnation, which registration must leave alone?
# -> that value, or nil when the key is free, ours, or holds anything kvd never writes
_HELD = _READ_NODE + """
local function held(key, max, id, inc)
  local code, cur = read_node(key, max)
  if code ~= 'V' then return nil end
  local ok, rec = pcall(cjson.decode, cur)
  if not ok or type(rec) ~= 'table' or rec['node_id'] ~= id or type(rec['incarnation']) ~= 'string'
     or rec['incarnation'] == inc then return nil end
  return cur
end
"""
# KEYS: node key, nodes zset, version. ARGV: value, incarnation, ttl ms, version base, max bytes, node id,
# the value the caller judged ('' = none). -> nil (registered) | the live value that holds the name
REGISTER = _BUMP + _HELD + """
local cur = held(KEYS[1], tonumber(ARGV[5]), ARGV[6], ARGV[2])
if cur and cur ~= ARGV[7] then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
index_ok(KEYS[2])
redis.call('ZADD', KEYS[2], now_ms() + tonumber(ARGV[3]), KEYS[1])
bump(KEYS[3], ARGV[4])
return false
"""
# KEYS: node key, nodes zset, version. ARGV: incarnation, ttl ms, new value or '', version base, max bytes.
# -> 1 ok, 0 gone, -1 not ours. A plain refresh leaves the listing (and its version) as it was.
REFRESH = _BUMP + _READ_NODE + """
local code, cur = read_node(KEYS[1], tonumber(ARGV[5]))
if code == '' then return 0 end
if code ~= 'V' and code ~= 'N' then return -1 end
if code == 'N' then cur = redis.call('GET', KEYS[1]) end
local ok, rec = pcall(cjson.decode, cur)
if not ok or type(rec) ~= 'table' or rec['incarnation'] ~= ARGV[1] then return -1 end
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
  bump(KEYS[3], ARGV[4])
else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
index_ok(KEYS[2])
redis.call('ZADD', KEYS[2], now_ms() + tonumber(ARGV[2]), KEYS[1])
return 1
"""
# KEYS: node key, nodes zset, version. ARGV: incarnation, version base, max bytes
UNREGISTER = _BUMP + _READ_NODE + """
local code, cur = read_node(KEYS[1], tonumber(ARGV[3]))
local gone = 0
if code == 'V' then
  local ok, rec = pcall(cjson.decode, cur)
  if ok and type(rec) == 'table' and rec['incarnation'] == ARGV[1] then gone = redis.call('DEL', KEYS[1]) end
end
index_ok(KEYS[2])
if redis.call('ZREM', KEYS[2], KEYS[1]) + gone > 0 then bump(KEYS[3], ARGV[2]) end
return 1
"""
# KEYS: node key. ARGV: the exact value. -> 1 when the key holds it, byte for byte, under a TTL
CHECK = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' or redis.call('PTTL', KEYS[1]) < 0 then return 0 end
if redis.call('STRLEN', KEYS[1]) ~= #ARGV[1] then return 0 end
if redis.call('GET', KEYS[1]) == ARGV[1] then return 1 end
return 0
"""
# KEYS: node key. ARGV: max bytes. -> {code, value}
GET_NODE = _READ_NODE + """
local code, value = read_node(KEYS[1], tonumber(ARGV[1]))
return {code, value}
"""
# One page of the node listing. KEYS: nodes zset, version. ARGV: version base, the version the caller
# has read ('' = none), ZSCAN cursor ('0' = the first page), page size, node key prefix, max bytes.
# -> {version, 0} when the first page finds the listing still at that version, else
#    {version, 1, next cursor ('0' = done), member, value, member, value, ...}, where a skipped
#    member's value is the integer LIST_CODES gives its code (two replies a member, not three: at 100k
#    members redis-py's parsing is a good part of a listing's cost)
# The first page drops index members whose score (expiry) has passed. ZSCAN returns every member
# present for the whole scan at least once (duplicates possible), however scores change meanwhile.
LIST = _BUMP + _READ_NODE + """
if ARGV[3] == '0' then
  index_ok(KEYS[1])
  if redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms()) > 0 then bump(KEYS[2], ARGV[1]) end
end
local version = redis.call('GET', KEYS[2])
if ARGV[3] == '0' and ARGV[2] ~= '' and version == ARGV[2] then return {version, 0} end
local scan = redis.call('ZSCAN', KEYS[1], ARGV[3], 'COUNT', ARGV[4])
local out = {version, 1, scan[1]}
local items, prefix, max = scan[2], ARGV[5], tonumber(ARGV[6])
local codes = {L = 1, N = 2, T = 3, P = 4}
local good = {}
for i = 1, #items, 2 do
  local m = items[i]
  local code = 'P'
  if string.sub(m, 1, #prefix) == prefix then code = node_state(m, max) end
  if code == 'V' then good[#good + 1] = m
  elseif code ~= '' then out[#out + 1] = m; out[#out + 1] = codes[code] end
end
if #good > 0 then  -- one MGET of this page's readable keys (a page, never the whole index)
  for i, v in ipairs(redis.call('MGET', unpack(good))) do out[#out + 1] = good[i]; out[#out + 1] = v end
end
return out
"""
LIST_CODES = {1: b"L", 2: b"N", 3: b"T", 4: b"P"}
# KEYS: holders hash. ARGV: node key prefix, max holders, max bytes.
# -> {field, code, holder value, node code, node value, ...}: at most max holders (a random choice
# of that many when a flood planted more; HRANDFIELD returns fields only, values stay in Redis)
HOLDERS = _READ_NODE + """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'hash' then return {t} end
local out, max = {}, tonumber(ARGV[3])
for _, f in ipairs(redis.call('HRANDFIELD', KEYS[1], tonumber(ARGV[2]))) do
  local code, value = 'V', ''
  local n = redis.call('HSTRLEN', KEYS[1], f)
  if n > max then code, value = 'L', n else value = redis.call('HGET', KEYS[1], f) end
  local ncode, nvalue = read_node(ARGV[1] .. f, max)
  out[#out + 1] = f; out[#out + 1] = code; out[#out + 1] = value
  out[#out + 1] = ncode; out[#out + 1] = nvalue
end
return out
"""
# KEYS: holders hash. ARGV: field, value, ttl ms (the hash lives as long as its longest entry). A key
# of another type in its place (planted) is replaced, so that it cannot fail every publish of a batch.
PUBLISH = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'hash' and t ~= 'none' then redis.call('DEL', KEYS[1]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
"""
# KEYS: holders hash. ARGV: field, value: delete only the exact record that was written
UNPUBLISH = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then return 0 end
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""
