-- Delete entries outright. ARGV: P, key_1..key_n. Returns how many existed.
local removed = 0
for i = 2, #ARGV do removed = removed + remove_entry(ARGV[1], ARGV[i]) end
return removed
