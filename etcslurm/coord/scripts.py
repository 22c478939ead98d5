"""Server-side Lua for the few operations that must be atomic or size-bounded.

Why Lua: a bounded read must refuse an oversized value *before* it crosses the network,
and the generation compare-and-set must be one atomic step so that exactly one of several
would-be leaders wins.  The scripts only read and write strings/hashes; nothing is
deserialized into code on either side.  Errors come back as ``ETCSLURM ...`` replies.
"""

from __future__ import annotations

# KEYS[1] key; ARGV[1] max bytes.  Returns the value or nil.
GET_BOUNDED = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return false end
if t ~= 'string' then return redis.error_reply('ETCSLURM ' .. KEYS[1] .. ' holds a ' .. t .. ', expected a JSON string') end
local n = redis.call('STRLEN', KEYS[1])
if n > tonumber(ARGV[1]) then
  return redis.error_reply('ETCSLURM ' .. KEYS[1] .. ' is ' .. n .. ' bytes, over the ' .. ARGV[1] .. '-byte limit')
end
return redis.call('GET', KEYS[1])
"""

# KEYS[1] hash; ARGV[1] max bytes per value; ARGV[2] max fields.  Returns HGETALL's list.
HGETALL_BOUNDED = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return {} end
if t ~= 'hash' then return redis.error_reply('ETCSLURM ' .. KEYS[1] .. ' holds a ' .. t .. ', expected a hash') end
local n = redis.call('HLEN', KEYS[1])
if n > tonumber(ARGV[2]) then
  return redis.error_reply('ETCSLURM ' .. KEYS[1] .. ' has ' .. n .. ' entries, over the limit of ' .. ARGV[2])
end
local all = redis.call('HGETALL', KEYS[1])
local max = tonumber(ARGV[1])
for i = 2, #all, 2 do
  if #all[i] > max then
    return redis.error_reply('ETCSLURM ' .. KEYS[1] .. '[' .. all[i - 1] .. '] is ' .. #all[i] .. ' bytes, over the ' .. ARGV[1] .. '-byte limit')
  end
end
return all
"""

# The current generation's number: the small ``gen_no`` key, or (a record written
# without it: an older etcslurm, a hand-edited key) decoded from the record.  Used inside
# the scripts below (a malformed record comes back as an error table: return it).
_GEN_NUMBER = """
local function gen_number(no_key, gen_key)
  local no = redis.call('GET', no_key)
  if no then return tonumber(no) end
  local cur = redis.call('GET', gen_key)
  if not cur then return -1 end
  local ok, obj = pcall(cjson.decode, cur)
  if not ok or type(obj) ~= 'table' or type(obj['generation']) ~= 'number' then
    return redis.error_reply('ETCSLURM ' .. gen_key .. ' is malformed (no generation number)')
  end
  return obj['generation']
end
"""

# Generation compare-and-set.  KEYS[1] gen; KEYS[2] gen_no; KEYS[3] news stream;
# ARGV[1] expected current number (-1: none); ARGV[2] new record JSON; ARGV[3] its number;
# ARGV[4] stream cap.  Returns {1, previous} when set, {0, current} when another won.
# The record, its number and a ``gen`` notice on the news stream are written in one
# atomic step, so a waiter that reads the number (O(1)) or blocks on the stream never
# sees one without the other.
GEN_CAS = _GEN_NUMBER + """
local curn = gen_number(KEYS[2], KEYS[1])
if type(curn) == 'table' then return curn end
if curn ~= tonumber(ARGV[1]) then return {0, curn} end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'gen', ARGV[3])
return {1, curn}
"""

# What a waiting worker needs to know, O(1) whatever the run's size.  KEYS[1] gen;
# KEYS[2] gen_no; KEYS[3] committed; KEYS[4] news stream.  Returns {current generation
# (-1: none), committed generation (-1: none), id of the newest notice ('0-0': none)}:
# block on the stream after that id (XREAD) to hear of the next publish or commit.
GEN_HEAD = _GEN_NUMBER + """
local curn = gen_number(KEYS[2], KEYS[1])
if type(curn) == 'table' then return curn end
local committed = tonumber(redis.call('GET', KEYS[3]) or '-1')
local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
local cursor = '0-0'
if #last > 0 then cursor = last[1][1] end
return {curn, committed, cursor}
"""

# Heartbeat with self-healing membership (a restarted Redis without persistence lost the
# run's keys: each live worker puts its own entry back).
# After end_run (tombstone KEYS[5]) nothing is re-created: the run is over.
# KEYS[1] hb key; KEYS[2] workers hash; KEYS[3] worker_seq; KEYS[4] spec; KEYS[5] ended
# ARGV[1] worker id; ARGV[2] ttl ms; ARGV[3] hb value; ARGV[4] info JSON; ARGV[5] seq
# number of this worker; ARGV[6] spec JSON ('' if none).
# Returns the state stored for this worker (after healing), or 'ended'.
HEARTBEAT = """
if redis.call('EXISTS', KEYS[5]) == 1 then return 'ended' end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if not cur then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
  local seq = tonumber(redis.call('GET', KEYS[3]) or '0')
  if seq < tonumber(ARGV[5]) then redis.call('SET', KEYS[3], ARGV[5]) end
  if ARGV[6] ~= '' then redis.call('SET', KEYS[4], ARGV[6], 'NX') end
  return 'healed'
end
local ok, obj = pcall(cjson.decode, cur)
if ok and type(obj) == 'table' and type(obj['state']) == 'string' then return obj['state'] end
return 'malformed'
"""

# Writes that exiting workers make after end_run must not re-create the run's keys.
# KEYS[1] hash; KEYS[2] ended tombstone; ARGV[1] field; ARGV[2] value.  1 = written.
HSET_UNLESS_ENDED = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# KEYS[1] stream; KEYS[2] ended; ARGV[1] max length; ARGV[2..] field/value pairs.
# Returns the entry id, or false after end_run (the run.end event itself is written
# before the tombstone).
XADD_UNLESS_ENDED = """
if redis.call('EXISTS', KEYS[2]) == 1 then return false end
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 2))
"""

# The commit.  KEYS[1] committed; KEYS[2] ended; KEYS[3] news stream; ARGV[1] candidate;
# ARGV[2] stream cap.  Sets KEYS[1] to the larger of the two (a commit never goes back)
# and, when it moved, adds a ``committed`` notice to the stream (waking the leavers that
# wait for it); nothing after end_run.  Returns the value now stored.
COMMIT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return false end
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
local new = tonumber(ARGV[1])
if new > cur then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'committed', ARGV[1])
  return new
end
return cur
"""
