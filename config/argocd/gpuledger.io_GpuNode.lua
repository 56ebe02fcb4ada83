-- Argo CD health of a GpuNode: Degraded while its Healthy condition is False (a GPU failed or
-- the device plugin stopped publishing), Progressing until the plugin published an inventory.
local hs = {status = "Progressing", message = "waiting for the device plugin's inventory"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Healthy" then
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
