//! placeholder: pod-facing API parsing (owned by the fit-engine work)
