-- Shared by every prefixcache script. Key layout under the prefix P (e.g. "pc:"):
--   P e:<key>     HASH   one chunk entry: parent root ns tenant ntok size ctime atime hits pin probe,
--                        plus one field "l:<tier>@<node>" per location (value: ms it was added)
--   P k:<parent>  SET    keys of the chunks registered directly below <parent>
--   P b:<probe>   HASH   probe bucket: <key> -> packed tokens of chunks sharing parent and first tokens
--   P ns          HASH   namespace digest -> canonical description (JSON)
--   P f:<node>    STREAM change feed of the locations on <node>: entries {op=add|drop, tier, key}
--                        (the node's daemon persists what lands in its DRAM; routers may subscribe)
-- All keys of one call live under one prefix on one Redis (standalone or replicated, not Cluster).

local FEED_MAXLEN = 1000000

local function feed(P, op, location, key)
  local at = string.find(location, '@', 1, true)
  redis.call('XADD', P .. 'f:' .. string.sub(location, at + 1), 'MAXLEN', '~', FEED_MAXLEN, '*',
    'op', op, 'tier', string.sub(location, 1, at - 1), 'key', key)
end

local function remove_entry(P, key)
  local e = P .. 'e:' .. key
  local f = redis.call('HMGET', e, 'parent', 'probe')
  if not f[1] then return 0 end
  local fields = redis.call('HKEYS', e)
  for i = 1, #fields do
    if string.sub(fields[i], 1, 2) == 'l:' then feed(P, 'drop', string.sub(fields[i], 3), key) end
  end
  redis.call('DEL', e)
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
