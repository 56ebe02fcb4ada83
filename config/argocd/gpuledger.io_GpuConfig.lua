-- Argo CD health of a GpuConfig: Healthy once the operator found every value applicable
-- (Ready=True), Degraded when it refused some (Ready=False; the message names each and why).
local hs = {status = "Progressing", message = "waiting for the operator"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Ready" then
    if c.status == "True" then
      hs.status = "Healthy"
    else
      hs.status = "Degraded"
    end
    hs.message = c.message or c.reason or ""
    return hs
  end
end
return hs
