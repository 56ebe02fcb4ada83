-- Argo CD health of a GpuReservation. Degraded when the ledger and what runs disagree
-- (Misaligned: the kubelet handed out other GPUs; KubeletMismatch: another pod holds its
-- replicas) or the admission failed; Progressing until the pod's containers hold the GPUs.
local hs = {status = "Progressing", message = "waiting for the operator's first status"}
if obj.status == nil then
  return hs
end
if obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    if (c.type == "Misaligned" or c.type == "KubeletMismatch") and c.status == "True" then
      hs.status = "Degraded"
      hs.message = c.type .. ": " .. (c.message or "")
      return hs
    end
  end
end
local phase = obj.status.phase or "Reserved"
if phase == "Allocated" then
  hs.status = "Healthy"
  hs.message = "the pod's GPU containers hold the reserved GPUs"
elseif phase == "Released" then
  hs.status = "Healthy"
  hs.message = "released: the pod no longer holds GPUs"
elseif phase == "Failed" then
  hs.status = "Degraded"
  hs.message = "the admission failed; the GPUs were released"
else
  hs.message = "phase " .. phase .. ": the pod is being bound and admitted"
end
return hs
