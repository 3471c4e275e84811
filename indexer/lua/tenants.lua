-- Count in their tenant's usage (S tu) the entries of one page of the key listing that are not in it: those an
-- earlier version registered, which kept no such count or another. ARGV: names, S, after (a key, or '' to start),
-- count. Returns {the page's last key ('' when the listing is done), how many entries it counted}. Each entry is
-- counted once however many callers page through at the same time: the mark and the count change together.
local S, after, count = ARGV[2], ARGV[3], tonumber(ARGV[4])
local from = after == '' and '-' or '(' .. after
local keys = redis.call('ZRANGE', S .. K.listing, from, '+', 'BYLEX', 'LIMIT', 0, count)
local counted = 0
for i = 1, #keys do
  local C = resolve(S, keys[i])
  if C then
    local e = C .. K.entry .. keys[i]
    local f = redis.call('HMGET', e, 'tenant', 'size', 'counted')
    if f[1] and f[2] and not f[3] then
      redis.call('HSET', e, 'counted', 1)
      tally_tenant(S, f[1], f[2], 1)
      counted = counted + 1
    end
  end
end
if #keys < count then return {'', counted} end
return {keys[#keys], counted}
