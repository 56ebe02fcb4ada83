//! Per-node simulated GPU topologies. Every simulated node reads the same sample file
//! (`config/samples/devices-8gpu-2numa.yaml`), but GPU UUIDs are unique cluster-wide on real
//! hardware and the ledger keys devices by UUID, so each node gets its own copy with the node's
//! number written into the UUID's second group (`GPU-00000003-0002-4000-…` is GPU 3 of node 2).

use std::path::Path;

use serde_yaml::Value;

use crate::sim::SimNodeError;

/// One GPU of a topology file, as far as the simulation needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimGpu {
    /// Its UUID (after rewriting).
    pub uuid: String,
    /// Its index on the node.
    pub index: u32,
    /// Its NUMA node, if the file gives one.
    pub numa: Option<u32>,
}

/// Writes the UUID of a GPU of node `node` (1-based): the second UUID group becomes the node
/// number in hex. UUIDs that do not look like `GPU-xxxxxxxx-xxxx-…` get `-n<node>` appended, so
/// they stay unique either way.
pub fn node_uuid(uuid: &str, node: u32) -> String {
    let parts: Vec<&str> = uuid.split('-').collect();
    if parts.len() == 6 && parts[0] == "GPU" && parts[2].len() == 4 {
        let mut out: Vec<String> = parts.iter().map(|p| p.to_string()).collect();
        out[2] = format!("{:04x}", node & 0xffff);
        out.join("-")
    } else {
        format!("{uuid}-n{node}")
    }
}

/// Reads `template`, rewrites every GPU's UUID for node `node` (see [`node_uuid`]), and returns
/// the new YAML with the GPUs it lists.
pub fn topology_for_node(
    template_text: &str,
    template: &Path,
    node: u32,
) -> Result<(String, Vec<SimGpu>), SimNodeError> {
    let yaml_err = |source| SimNodeError::DevicesFile {
        path: template.to_path_buf(),
        problem: format!("{source}"),
    };
    let mut doc: Value = serde_yaml::from_str(template_text).map_err(yaml_err)?;
    let gpus = doc
        .get_mut("gpus")
        .and_then(Value::as_sequence_mut)
        .ok_or_else(|| SimNodeError::DevicesFile {
            path: template.to_path_buf(),
            problem: "no `gpus` list".into(),
        })?;
    let mut listed = Vec::new();
    for gpu in gpus.iter_mut() {
        let uuid =
            gpu.get("uuid")
                .and_then(Value::as_str)
                .ok_or_else(|| SimNodeError::DevicesFile {
                    path: template.to_path_buf(),
                    problem: "a GPU has no uuid".into(),
                })?;
        let new_uuid = node_uuid(uuid, node);
        let index = gpu.get("index").and_then(Value::as_u64).unwrap_or(0);
        let numa = gpu.get("numaNode").and_then(Value::as_u64);
        listed.push(SimGpu {
            uuid: new_uuid.clone(),
            index: u32::try_from(index).unwrap_or(u32::MAX),
            numa: numa.and_then(|n| u32::try_from(n).ok()),
        });
        if let Some(map) = gpu.as_mapping_mut() {
            map.insert(Value::from("uuid"), Value::from(new_uuid));
        }
    }
    let text = serde_yaml::to_string(&doc).map_err(yaml_err)?;
    let header = format!(
        "# Generated from {} for simulated node {node}: UUIDs rewritten to be unique per node.\n",
        template.display()
    );
    Ok((header + &text, listed))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = include_str!("../../../config/samples/devices-8gpu-2numa.yaml");

    #[test]
    fn uuids_carry_the_node_number() {
        assert_eq!(
            node_uuid("GPU-00000003-0000-4000-8000-000000000003", 2),
            "GPU-00000003-0002-4000-8000-000000000003"
        );
        assert_eq!(node_uuid("GPU-weird", 3), "GPU-weird-n3");
    }

    #[test]
    fn the_sample_becomes_eight_unique_gpus_on_two_numa_nodes_per_node() {
        let path = Path::new("devices-8gpu-2numa.yaml");
        let (text1, gpus1) = topology_for_node(SAMPLE, path, 1).unwrap();
        let (_, gpus2) = topology_for_node(SAMPLE, path, 2).unwrap();
        assert_eq!(gpus1.len(), 8);
        let numas: Vec<Option<u32>> = gpus1.iter().map(|g| g.numa).collect();
        assert_eq!(numas[..4], [Some(0); 4]);
        assert_eq!(numas[4..], [Some(1); 4]);
        for (a, b) in gpus1.iter().zip(&gpus2) {
            assert_ne!(a.uuid, b.uuid);
            assert_eq!(a.index, b.index);
        }
        // The rewritten file still parses, with the new UUIDs and the other fields kept.
        let doc: Value = serde_yaml::from_str(&text1).unwrap();
        let first = &doc["gpus"][0];
        assert_eq!(
            first["uuid"].as_str(),
            Some("GPU-00000000-0001-4000-8000-000000000000")
        );
        assert_eq!(first["memoryMiB"].as_u64(), Some(81559));
        assert_eq!(first["pciBusId"].as_str(), Some("0000:18:00.0"));
    }

    #[test]
    fn a_file_without_gpus_is_a_clear_error() {
        let err = topology_for_node("foo: 1\n", Path::new("bad.yaml"), 1).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("bad.yaml") && msg.contains("gpus"), "{msg}");
    }
}
