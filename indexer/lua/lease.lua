-- Lease chunks until Redis's clock reaches now + ttl, keeping any longer lease; drop expired leases first.
-- KEYS: the lease set. ARGV: ttl_s, key_1..key_n (the set maps key -> expiry, Unix seconds).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local expiry = now + tonumber(ARGV[1])
for first = 2, #ARGV, 4096 do
  local args = {}
  for i = first, math.min(#ARGV, first + 4095) do
    args[#args + 1] = expiry
    args[#args + 1] = ARGV[i]
  end
  redis.call('ZADD', KEYS[1], 'GT', unpack(args))
end
return 1
