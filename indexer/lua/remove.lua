-- Delete entries outright. ARGV: names, S, key_1..key_n. Returns {how many existed on this shard, elsewhere}
-- (see remove_entry).
local S = ARGV[2]
local removed, elsewhere = 0, {}
for i = 3, #ARGV do
  local C = resolve(S, ARGV[i])
  if C then removed = removed + remove_entry(S, C, ARGV[i], elsewhere) end
end
return {removed, elsewhere}
