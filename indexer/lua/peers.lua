-- Which nodes answer (indexer/peers.py), in one hash KEYS[1] (R peers) by the shard's clock, never a client's:
--   beat:<node>     ms until which the node's daemon is alive (its last heartbeat plus the heartbeat's time to live)
--   suspect:<node>  ms until which a client that could not read from the node has marked it suspect
--   left:<node>     ms when the node's daemon stopped on purpose (its heartbeat lapsed then)
--   marks:<node>    how many times clients have marked the node suspect
--   strikes:<node>  marks in a row: each doubles the next mark's length
-- ARGV: op, node, ms (and for 'beat': back_ms; for 'suspect': longest_ms, forgive_ms).
--   'beat'    the node is alive for ms more; fields that lapsed more than a day ago are forgotten, and with a
--             node's heartbeat its marks. A node whose heartbeat had lapsed for back_ms or more is back from a
--             loss: its marks in a row, and a mark still holding, are dropped
--   'leave'   the node stops on purpose: its heartbeat lapses now
--   'suspect' mark the node suspect: a mark still holding is kept; else for ms doubled per mark in a row (at most
--             longest_ms), the row starting again when the last mark lapsed more than forgive_ms ago
--   'read'    returns {now_ms, field_1, value_1, ...}
local op, node, ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if op == 'read' then
  return {tostring(now), redis.call('HGETALL', KEYS[1])}
elseif op == 'beat' then
  local lapsed = tonumber(redis.call('HGET', KEYS[1], 'beat:' .. node) or now)
  if lapsed <= now - tonumber(ARGV[4]) then redis.call('HDEL', KEYS[1], 'strikes:' .. node, 'suspect:' .. node) end
  redis.call('HSET', KEYS[1], 'beat:' .. node, now + ms)
  redis.call('HDEL', KEYS[1], 'left:' .. node)
  local fields = redis.call('HGETALL', KEYS[1])
  for i = 1, #fields, 2 do
    local kind, _, peer = string.match(fields[i], '^(%a+)(:)(.*)$')
    if kind ~= 'marks' and kind ~= 'strikes' and tonumber(fields[i + 1]) < now - 86400000 then
      redis.call('HDEL', KEYS[1], fields[i])
      if kind == 'beat' then redis.call('HDEL', KEYS[1], 'marks:' .. peer) end
    end
  end
elseif op == 'leave' then
  redis.call('HSET', KEYS[1], 'beat:' .. node, now, 'left:' .. node, now)
elseif op == 'suspect' then
  local longest, forgive = tonumber(ARGV[4]), tonumber(ARGV[5])
  local held = tonumber(redis.call('HGET', KEYS[1], 'suspect:' .. node) or '0')
  if held <= now then
    local strikes = tonumber(redis.call('HGET', KEYS[1], 'strikes:' .. node) or '0')
    if held < now - forgive then strikes = 0 end
    local length = ms
    for _ = 1, strikes do length = math.min(length * 2, longest) end
    redis.call('HSET', KEYS[1], 'suspect:' .. node, now + length, 'strikes:' .. node, strikes + 1)
  end
  redis.call('HINCRBY', KEYS[1], 'marks:' .. node, 1)
end
return {tostring(now)}
