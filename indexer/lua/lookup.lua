#!lua flags=no-writes,allow-cross-slot-keys
-- Longest cached prefixes of one or more chains in one round trip; read-only, so it may run on a replica. On a
-- Cluster the chains of one call are those one master holds: each in a slot of its own.
-- ARGV: names (common.lua), max_candidates, heads_elsewhere, avoided, here, then C_1, keys_1, probes_1, C_2, ... where C is the chain's
-- prefix (common.lua: R on one Redis, R{<anchor>}: on a Cluster) and heads_elsewhere '1' where the probe bucket of a
-- chain's first chunk lies on another shard (a Cluster): a chain broken in its first chunk then returns no candidates,
-- and the client reads that bucket itself. avoided names the nodes to read nothing from (down or suspect:
-- indexer/peers.py) as ',a,b,', or is '': a chunk whose every copy lies on one of them ends the hit (a bucket copy,
-- object@<writer>, lies on no node: every node reads it), and only copies on other nodes count as DRAM copies. here names the asking node, or is '': a chunk with a DRAM copy on it is flagged '2'
-- rather than '1' (a read of it stays on the node). keys concatenates a chain's n keys (32 hex chars each); probes
-- concatenates the probe bucket of positions 0..n (32 '0's where the prompt has none). Returns one reply per chain,
-- {hits, in_dram, cand_key_1, cand_tokens_1, cand_in_dram_1, ...}: the number of leading keys present; per such key '1'
-- if it has a DRAM location ('2' on here), else '0'; then the chunks in the probe bucket at the break point (the client
-- picks the longest token match), each with its own flag. Several chains are the shards of one prompt under tensor
-- parallelism.
local max_candidates = tonumber(ARGV[2])
local heads_elsewhere = ARGV[3] == '1'
local avoided = ARGV[4]
local here = ARGV[5]

-- With nodes to avoid: whether the entry has a copy on another node, and whether one of those is a DRAM copy.
local function reachable(name)
  local any, dram = false, false
  for _, field in ipairs(redis.call('HKEYS', name)) do
    if string.sub(field, 1, 2) == 'l:' then
      local at = string.find(field, '@', 1, true)
      local tier = string.sub(field, 3, at - 1)
      if tier == 'object' or not string.find(avoided, ',' .. string.sub(field, at + 1) .. ',', 1, true) then
        any = true
        dram = dram or tier == 'dram'
      end
    end
  end
  return any, dram and '1' or '0'
end

local function longest(P, keys, probes)
  local n = #keys / 32
  local names = {}
  for i = 1, n do names[i] = P .. K.entry .. string.sub(keys, i * 32 - 31, i * 32) end

  -- Chains are nearly always contiguous from the start, so one multi-key EXISTS usually settles it:
  -- all present, or exactly the first c of them. Only a chain with holes needs the key-by-key scan.
  -- (unpack takes up to ~7900 values: prompts of up to 2M tokens at 256-token chunks.)
  local function count_present(last)
    local present = 0
    for first = 1, last, 4096 do
      present = present + redis.call('EXISTS', unpack(names, first, math.min(last, first + 4095)))
    end
    return present
  end
  local hits = 0
  if n > 0 then
    local c = count_present(n)
    if c == n or (c > 0 and count_present(c) == c) then
      hits = c
    else
      for i = 1, n do
        if redis.call('EXISTS', names[i]) == 0 then break end
        hits = i
      end
    end
  end
  -- Entries count their DRAM copies ("dram"); one written before that field existed counts as in DRAM.
  local function dram_flag(name)
    return redis.call('HGET', name, 'dram') == '0' and '0' or '1'
  end
  -- '1' becomes '2' for a DRAM copy on the asking node
  local function here_flag(name, flag)
    if flag == '1' and here ~= '' and redis.call('HGET', name, 'l:dram@' .. here) then return '2' end
    return flag
  end
  local in_dram = {}
  for i = 1, hits do
    if avoided == '' then
      in_dram[i] = here_flag(names[i], dram_flag(names[i]))
    else
      local any, flag = reachable(names[i])
      if not any then
        hits = i - 1
        break
      end
      in_dram[i] = here_flag(names[i], flag)
    end
  end
  local out = {hits, table.concat(in_dram)}
  local probe = string.sub(probes, hits * 32 + 1, hits * 32 + 32)
  if probe ~= '' and probe ~= string.rep('0', 32) and not (hits == 0 and heads_elsewhere) then
    -- a positive count returns distinct fields: the whole bucket when it holds no more than that
    local fields = redis.call('HRANDFIELD', P .. K.bucket .. probe, max_candidates, 'WITHVALUES')
    for j = 1, #fields, 2 do
      local name = P .. K.entry .. fields[j]
      if redis.call('EXISTS', name) == 1 then
        local any, flag = true, nil
        if avoided == '' then flag = dram_flag(name) else any, flag = reachable(name) end
        if any then
          out[#out + 1] = fields[j]
          out[#out + 1] = fields[j + 1]
          out[#out + 1] = here_flag(name, flag)
        end
      end
    end
  end
  return out
end

local replies = {}
for q = 6, #ARGV, 3 do replies[#replies + 1] = longest(ARGV[q], ARGV[q + 1], ARGV[q + 2]) end
return replies
