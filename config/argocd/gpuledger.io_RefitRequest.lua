-- Argo CD health of a RefitRequest: a refit waiting for its answer is Progressing, a refused
-- one Degraded (its reason says why the reservation could not move), an answered one Healthy.
local hs = {status = "Progressing", message = "waiting for the operator's answer"}
if obj.status == nil or obj.status.phase == nil or obj.status.phase == "Pending" then
  return hs
end
if obj.status.phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = "refitted"
else
  hs.status = "Degraded"
  hs.message = "refit refused: " .. (obj.status.reason or "no reason given")
end
return hs
