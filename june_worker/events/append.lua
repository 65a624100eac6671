-- Append structural events to one stream exactly once, in seq order (see redis_stream.py).
--
-- KEYS[1]  the stream
-- KEYS[2]  its marker: a string key (ARGV[1] == '') or a hash (field ARGV[1]), same hash slot
-- KEYS[3]  with a hash marker: a sorted set, same slot, field -> when it last appended (ms), so that
--          fields of sessions gone quiet can be dropped (the hash stays bounded)
-- ARGV[1]  hash field of the marker ('' for a string marker)
-- ARGV[2]  '1' lenient: append past a gap in seq; '0' strict: stop at the first gap
-- ARGV[3]  MAXLEN ('' for none)     ARGV[4]  '~' approximate or '=' exact trimming
-- ARGV[5]  MINID ('' for none)
-- ARGV[6]  with a string marker: the stream's and the marker's time to live after this append,
--          in ms ('' or '0' for none); the session's keys go once it has been quiet that long
-- ARGV[7..] triples: seq, type, data (the event as JSON), in seq order
--
-- Returns {appended, marker after, seq of the first event refused for a gap or 0}.
local stream, marker_key = KEYS[1], KEYS[2]
local field, lenient = ARGV[1], ARGV[2] == '1'
local maxlen, op, minid = ARGV[3], ARGV[4], ARGV[5]
local ttl = tonumber(ARGV[6]) or 0

local function recover()
  -- The marker is gone but the stream is not (evicted, deleted by hand): the newest
  -- structural entry of the stream's tail says how far it got. Deltas carry no seq.
  local tail = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1000)
  for _, entry in ipairs(tail) do
    local f = entry[2]
    local kind, data = nil, nil
    for j = 1, #f, 2 do
      if f[j] == 'type' then kind = f[j + 1] elseif f[j] == 'data' then data = f[j + 1] end
    end
    if data and kind ~= 'message.delta' and kind ~= 'reasoning.delta' then
      local ok, decoded = pcall(cjson.decode, data)
      if ok and type(decoded) == 'table' and type(decoded['seq']) == 'number' then
        return decoded['seq']
      end
    end
  end
  return 0
end

local marker, recovered = nil, false
if field == '' then
  marker = redis.call('GET', marker_key)
  if not marker and redis.call('EXISTS', stream) == 1 then
    marker, recovered = recover(), true
  end
else
  marker = redis.call('HGET', marker_key, field)
end
marker = tonumber(marker) or 0

-- Trimming rides on XADD (MAXLEN, else MINID); with both, MINID is applied once at the end.
local xadd = {'XADD', stream}
if maxlen ~= '' then
  xadd[3], xadd[4], xadd[5] = 'MAXLEN', op, maxlen
elseif minid ~= '' then
  xadd[3], xadd[4], xadd[5] = 'MINID', op, minid
end
local n = #xadd
xadd[n + 1], xadd[n + 2], xadd[n + 4] = '*', 'type', 'data'

local appended, gap = 0, 0
for i = 7, #ARGV, 3 do
  local seq = tonumber(ARGV[i])
  if seq > marker then
    if seq > marker + 1 and not lenient then
      gap = seq
      break
    end
    xadd[n + 3], xadd[n + 5] = ARGV[i + 1], ARGV[i + 2]
    redis.call(unpack(xadd, 1, n + 5))
    marker = seq
    appended = appended + 1
  end
end

if appended > 0 or recovered then
  if field == '' then
    redis.call('SET', marker_key, marker)
  else
    redis.call('HSET', marker_key, field, marker)
  end
end
if appended > 0 then
  if field == '' and ttl > 0 then
    redis.call('PEXPIRE', stream, ttl)
    redis.call('PEXPIRE', marker_key, ttl)
  elseif field ~= '' and KEYS[3] then
    local now = redis.call('TIME')
    redis.call('ZADD', KEYS[3], now[1] * 1000 + math.floor(now[2] / 1000), field)
  end
end
if appended > 0 and maxlen ~= '' and minid ~= '' then
  redis.call('XTRIM', stream, 'MINID', op, minid)
end
return {appended, marker, gap}
