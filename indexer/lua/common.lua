-- Shared by every prefixcache script. Key layout under the prefix P (e.g. "pc:"):
--   P e:<key>     HASH   one chunk entry: parent root ns tenant ntok size ctime atime hits pin probe,
--                        plus one field "l:<tier>@<node>" per location (value: ms it was added)
--                        and "dram", how many of them are DRAM copies (lookups read that one field)
--   P k:<parent>  SET    keys of the chunks registered directly below <parent>
--   P b:<probe>   HASH   probe bucket: <key> -> packed tokens of chunks sharing parent and first tokens
--   P ns          HASH   namespace digest -> canonical description (JSON)
--   P keys        ZSET   every entry's key (score 0), so listings page through keys in order
--   P u           HASH   usage per namespace: "<ns>:chunks" and "<ns>:bytes" count entries,
--                        "<ns>:<tier>:chunks" and "<ns>:<tier>:bytes" count copies in a tier
--   P f:<node>    STREAM change feed of the locations on <node>: entries {op=add|drop, tier, key}
--                        (the node's daemon persists what lands in its DRAM; routers may subscribe)
--   P lease       ZSET   chunk key -> lease expiry, Unix seconds (indexer/leases.py)
-- All keys of one call live under one prefix on one Redis (standalone or replicated, not Cluster).
-- Times written (ctime, atime, a location's ms) are Redis's own clock, never a client's: every node reads
-- and compares them against one clock. Redis 7 replicates scripts by their effects, so TIME is allowed here.

local FEED_MAXLEN = 1000000

-- Redis's clock, in ms since the epoch, as a string (exact: no float on the way).
local function now_ms()
  local t = redis.call('TIME')
  return t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
end

local function feed(P, op, location, key)
  local at = string.find(location, '@', 1, true)
  redis.call('XADD', P .. 'f:' .. string.sub(location, at + 1), 'MAXLEN', '~', FEED_MAXLEN, '*',
    'op', op, 'tier', string.sub(location, 1, at - 1), 'key', key)
end

-- Add sign * (1 chunk, size bytes) to a namespace's usage; scope is '' (entries) or '<tier>:' (copies).
local function tally(P, ns, scope, size, sign)
  redis.call('HINCRBY', P .. 'u', ns .. ':' .. scope .. 'chunks', sign)
  redis.call('HINCRBY', P .. 'u', ns .. ':' .. scope .. 'bytes', sign * tonumber(size))
end

-- Count an added (+1) or dropped (-1) location in the entry's "dram" field if it is a DRAM copy.
local function count_dram(e, location, sign)
  if string.sub(location, 1, 5) == 'dram@' then redis.call('HINCRBY', e, 'dram', sign) end
end

local function tier_of(location)
  return string.sub(location, 1, string.find(location, '@', 1, true) - 1) .. ':'
end

local function remove_entry(P, key)
  local e = P .. 'e:' .. key
  local f = redis.call('HMGET', e, 'parent', 'probe', 'ns', 'size')
  if not f[1] then return 0 end
  local fields = redis.call('HKEYS', e)
  for i = 1, #fields do
    if string.sub(fields[i], 1, 2) == 'l:' then
      feed(P, 'drop', string.sub(fields[i], 3), key)
      tally(P, f[3], tier_of(string.sub(fields[i], 3)), f[4], -1)
    end
  end
  tally(P, f[3], '', f[4], -1)
  redis.call('DEL', e)
  redis.call('ZREM', P .. 'keys', key)
  redis.call('SREM', P .. 'k:' .. f[1], key)
  if f[2] and f[2] ~= '' then redis.call('HDEL', P .. 'b:' .. f[2], key) end
  return 1
end

local function has_location(e)
  local fields = redis.call('HKEYS', e)
  for i = 1, #fields do
    if string.sub(fields[i], 1, 2) == 'l:' then return true end
  end
  return false
end
