-- Shared by the index's scripts, which build no key name themselves: ARGV[1] hands them the keyspace's names
-- (Keyspace.script_names in indexer/keyspace.py) as words 'name=value', read here into K: K.root is R, the
-- index's prefix (e.g. "pc:"); K.entry, K.children, ... the names below, each after its prefix. The key layout,
-- generated from indexer/keyspace.py (make docs; tests/test_keyspace.py checks it):
-- BEGIN KEY LAYOUT
--  C e:<key>                      hash        one chunk entry: parent, root, ns, tenant, ntok, size, ctime, atime,
--                                             hits, pin, probe, one field l:<tier>@<node> per location (value: ms
--                                             it was added), dram, how many of those are DRAM copies, and counted
--                                             once the entry is in its tenant's usage
--  C k:<parent>                   set         keys registered directly below a parent (evict-by-prefix walks this)
--  C b:<probe>                    hash        probe bucket: key -> packed tokens of chunks sharing parent and first
--                                             tokens
--  R ns                           hash        namespace digest -> canonical description (JSON)
--  S keys                         sorted set  every entry's key (score 0): listings page through keys in order
--  S u                            hash        usage per namespace: "<ns>:chunks" and "<ns>:bytes" count entries,
--                                             "<ns>:<tier>:chunks" and "<ns>:<tier>:bytes" count copies in a tier
--  S tu                           hash        usage per tenant id over every namespace: "<tenant>:chunks" and
--                                             "<tenant>:bytes" count the entries marked "counted" ("" is the tenant
--                                             of chunks without a salt); entries an earlier version left unmarked
--                                             join it through tenants.lua
--  S f:<node>                     stream      change feed of the locations on <node>: entries {op=add|drop, tier,
--                                             key} (write-behind and KV events, one consumer group each)
--  S lease                        sorted set  chunk key -> lease expiry, Unix seconds (indexer/leases.py)
--  S a                            hash        (Cluster only) key -> anchor: which chain holds the entries this
--                                             shard has
--  R peers                        hash        which nodes answer: beat:<node>, suspect:<node>, strikes:<node>,
--                                             marks:<node>, left:<node> -> ms (indexer/peers.py)
--  R quotas                       hash        quotas set through /v1/quotas: tenant:<id> / namespace:<digest> ->
--                                             bytes
--  R quota:room                   string      the room each scope had at the quota loop's last round (JSON)
--  R quota:spent:<round>:<scope>  integer     bytes publishers spent of a scope's room (10 s TTL)
--  R quota:lock                   string      which node runs the quota loop (a lease, set NX PX)
--                                             (indexer/quotas.py)
--  R kvseq:<node>                 string      the sequence number of the node's last KV-event batch
--  R cs:<node>                    hash        client statistics summed per node: lookups, hits, tokens, latency
--                                             buckets
--  R pq:<node>                    list        promotion requests to one node's daemon
--  R pr:<id>                      list        one promotion request's streamed answers
--  R xq:<node>                    list        "where on your NVMe are these chunks?" requests to one node's daemon
--  R xr:<id>                      list        the answer to one extents request
--  R dq:<node>                    list        eviction orders to one node's daemon
--  R dr:<id>                      list        how many copies one eviction order removed
--  R deployment-probe             none        read (never written) to check the deployment answers reads and writes
-- END KEY LAYOUT
-- On one Redis, C = S = R. On a Cluster every key of one chain carries the chain's anchor, its first chunk's
-- key, as hash tag (C = R{<anchor>}:, with K.tag_open and K.tag_close around the tag), so a lookup reads one shard; S = R{<tag>}: names the keys shared by the
-- chains of one shard, with a tag that shard serves (indexer/redis_shards.py), so no key is written by
-- every registration of the fleet. The probe bucket of a chain's first chunk lies under the probe's own tag
-- (R{<probe>}:), on whichever shard serves it: writes to it are returned as "elsewhere" for the client to make.
-- Times written (ctime, atime, a location's ms) are the shard's own clock, never a client's. Redis 7
-- replicates scripts by their effects, so TIME is allowed here.

local FEED_MAXLEN = 1000000

local K = {}
for name, value in string.gmatch(ARGV[1], '([%w_]+)=(%S+)') do K[name] = value end
local R = K.root

-- C, where the keys of the chain anchored at anchor live ('' on one Redis: R).
local function chain_of(anchor)
  if anchor == '' then return R end
  return R .. K.tag_open .. anchor .. K.tag_close
end

-- The anchor of chain prefix C on a Cluster (chain_of's inverse).
local function anchor_of(C)
  return string.sub(C, #R + #K.tag_open + 1, -#K.tag_close - 1)
end

-- The chain prefix under which this shard holds key's entry: R on one Redis; on a Cluster, from the shard's
-- directory (nil when this shard holds no entry of key).
local function resolve(S, key)
  if R == S then return R end
  local anchor = redis.call('HGET', S .. K.directory, key)
  if not anchor then return nil end
  return chain_of(anchor)
end

-- Whether the entry of key, held under chain prefix C, begins its chain on a Cluster (its probe bucket and
-- its parent's set of children lie under other tags).
local function is_head(S, C, key)
  return R ~= S and C == chain_of(key)
end

-- Redis's clock, in ms since the epoch, as a string (exact: no float on the way).
local function now_ms()
  local t = redis.call('TIME')
  return t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
end

local function feed(S, op, location, key)
  local at = string.find(location, '@', 1, true)
  redis.call('XADD', S .. K.feed .. string.sub(location, at + 1), 'MAXLEN', '~', FEED_MAXLEN, '*',
    'op', op, 'tier', string.sub(location, 1, at - 1), 'key', key)
end

-- Add sign * (1 chunk, size bytes) to a namespace's usage; scope is '' (entries) or '<tier>:' (copies).
local function tally(S, ns, scope, size, sign)
  redis.call('HINCRBY', S .. K.usage, ns .. ':' .. scope .. 'chunks', sign)
  redis.call('HINCRBY', S .. K.usage, ns .. ':' .. scope .. 'bytes', sign * tonumber(size))
end

-- Add sign * (1 entry, size bytes) to a tenant's usage.
local function tally_tenant(S, tenant, size, sign)
  redis.call('HINCRBY', S .. K.tenant_usage, tenant .. ':chunks', sign)
  redis.call('HINCRBY', S .. K.tenant_usage, tenant .. ':bytes', sign * tonumber(size))
end

-- Count an added (+1) or dropped (-1) location in the entry's "dram" field if it is a DRAM copy.
local function count_dram(e, location, sign)
  if string.sub(location, 1, 5) == 'dram@' then redis.call('HINCRBY', e, 'dram', sign) end
end

local function tier_of(location)
  return string.sub(location, 1, string.find(location, '@', 1, true) - 1) .. ':'
end

-- Delete key's entry held under C; a head's probe bucket membership is appended to elsewhere as
-- (probe, key) for the client to drop on the bucket's own shard.
local function remove_entry(S, C, key, elsewhere)
  local e = C .. K.entry .. key
  local f = redis.call('HMGET', e, 'parent', 'probe', 'ns', 'size', 'tenant', 'counted')
  if not f[1] then return 0 end
  local fields = redis.call('HKEYS', e)
  for i = 1, #fields do
    if string.sub(fields[i], 1, 2) == 'l:' then
      feed(S, 'drop', string.sub(fields[i], 3), key)
      tally(S, f[3], tier_of(string.sub(fields[i], 3)), f[4], -1)
    end
  end
  tally(S, f[3], '', f[4], -1)
  if f[6] then tally_tenant(S, f[5], f[4], -1) end
  redis.call('DEL', e)
  redis.call('ZREM', S .. K.listing, key)
  local head = is_head(S, C, key)
  redis.call('SREM', (head and S or C) .. K.children .. f[1], key)
  if R ~= S then redis.call('HDEL', S .. K.directory, key) end
  if f[2] and f[2] ~= '' then
    if head then
      elsewhere[#elsewhere + 1] = f[2]
      elsewhere[#elsewhere + 1] = key
    else
      redis.call('HDEL', C .. K.bucket .. f[2], key)
    end
  end
  return 1
end

local function has_location(e)
  local fields = redis.call('HKEYS', e)
  for i = 1, #fields do
    if string.sub(fields[i], 1, 2) == 'l:' then return true end
  end
  return false
end
