//! Property tests of the `--devices-from` topology file and of the replica inventory built from
//! it: any text is parsed or refused with an error naming the file (never a panic), a valid
//! inventory survives a YAML round trip exactly, every broken inventory is refused with the
//! reason, and every advertised replica maps back to its own GPU and NUMA node.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gpuledger_crds::GpuDevice;
use gpuledger_device_plugin::discovery::DiscoveryError;
use gpuledger_device_plugin::discovery::file::parse;
use gpuledger_device_plugin::inventory::Inventory;
use proptest::prelude::*;

const ORIGIN: &str = "/etc/gpuledger/devices.yaml";

/// Up to 16 GPUs with distinct UUIDs (dashes included, the way real UUIDs have them) and
/// distinct indexes, in random order.
fn inventory() -> impl Strategy<Value = Vec<GpuDevice>> {
    prop::collection::btree_set("GPU-[0-9a-f]{1,8}(-[0-9a-f]{1,4}){0,3}", 1..16)
        .prop_flat_map(|uuids| {
            let n = uuids.len();
            (
                Just(uuids.into_iter().collect::<Vec<_>>()),
                prop::collection::vec(
                    (
                        "[A-Za-z0-9 -]{1,24}",
                        1u64..200_000,
                        prop::option::of(0u32..8),
                        any::<bool>(),
                        any::<bool>(),
                        1u32..=100,
                        prop::option::of("0000:[0-9a-f]{2}:00\\.0"),
                    ),
                    n,
                ),
                Just((0..n as u32).collect::<Vec<_>>()).prop_shuffle(),
            )
        })
        .prop_map(|(uuids, attrs, indexes)| {
            uuids
                .into_iter()
                .zip(attrs)
                .zip(indexes)
                .map(
                    |((uuid, (model, mem, numa, healthy, mig, cores, bus)), index)| GpuDevice {
                        uuid,
                        index,
                        model: model.trim().to_string() + "X",
                        memory_mib: mem,
                        cores,
                        numa_node: numa,
                        pci_bus_id: bus,
                        mig,
                        healthy,
                        link_scores: Default::default(),
                    },
                )
                .collect()
        })
}

/// The inventory written as the file format documents it.
fn to_yaml(gpus: &[GpuDevice]) -> String {
    let mut out = String::from("gpus:\n");
    for g in gpus {
        out.push_str(&format!(
            "  - uuid: {:?}\n    index: {}\n    model: {:?}\n    memoryMiB: {}\n    healthy: {}\n    mig: {}\n    cores: {}\n",
            g.uuid, g.index, g.model, g.memory_mib, g.healthy, g.mig, g.cores
        ));
        if let Some(n) = g.numa_node {
            out.push_str(&format!("    numaNode: {n}\n"));
        }
        if let Some(b) = &g.pci_bus_id {
            out.push_str(&format!("    pciBusId: {b:?}\n"));
        }
    }
    out
}

fn refusal(text: &str) -> String {
    match parse(ORIGIN, text) {
        Ok(gpus) => panic!("accepted {gpus:?} from\n{text}"),
        Err(e) => e.to_string(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// Arbitrary text (random, or YAML-ish with the file's keys) never panics; a refusal names
    /// the file and says why.
    #[test]
    fn any_text_is_parsed_or_refused_naming_the_file(
        text in prop_oneof![
            any::<String>(),
            "(gpus:\n)?(  - (uuid|index|model|memoryMiB|numaNode|healthy|mig|cores|pciBusId|extra): [-a-zA-Z0-9\" ]{0,10}\n){0,8}",
        ]
    ) {
        match parse(ORIGIN, &text) {
            Ok(gpus) => {
                prop_assert!(gpus.windows(2).all(|w| w[0].index < w[1].index), "sorted, unique indexes");
                prop_assert!(gpus.iter().all(|g| !g.uuid.trim().is_empty()));
            }
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.contains(ORIGIN), "{msg}");
                let expected_kind =
                    matches!(e, DiscoveryError::ParseFile { .. } | DiscoveryError::Invalid { .. });
                prop_assert!(expected_kind, "unexpected error kind: {msg}");
            }
        }
    }

    /// A valid inventory comes back exactly, ordered by index.
    #[test]
    fn valid_inventories_round_trip(gpus in inventory()) {
        let mut expected = gpus.clone();
        expected.sort_by_key(|g| g.index);
        prop_assert_eq!(parse(ORIGIN, &to_yaml(&gpus)).unwrap(), expected);
    }

    /// Duplicate UUIDs, duplicate indexes, blank and over-long UUIDs and unknown keys are each
    /// refused with the reason.
    #[test]
    fn broken_inventories_are_refused_with_the_reason(gpus in inventory(), pick in any::<prop::sample::Index>()) {
        let i = pick.index(gpus.len());
        let mut dup = gpus.clone();
        let mut copy = dup[i].clone();
        copy.index = 1000;
        dup.push(copy);
        prop_assert!(refusal(&to_yaml(&dup)).contains("appears twice"));

        let mut dup_index = gpus.clone();
        let mut other = dup_index[i].clone();
        other.uuid = "GPU-unique-extra".into();
        dup_index.push(other);
        let msg = refusal(&to_yaml(&dup_index));
        prop_assert!(msg.contains(&format!("index {} appears twice", gpus[i].index)), "{msg}");

        let mut blank = gpus.clone();
        blank[i].uuid = "  ".into();
        prop_assert!(refusal(&to_yaml(&blank)).contains("empty uuid"));

        let mut long = gpus.clone();
        long[i].uuid = format!("GPU-{}", "a".repeat(57));
        prop_assert!(refusal(&to_yaml(&long)).contains("longer than 60"));

        let unknown = to_yaml(&gpus).replacen("    index:", "    colour: red\n    index:", 1);
        prop_assert!(refusal(&unknown).contains("colour"));
    }

    /// Every replica the kubelet is shown maps back to its own GPU and carries that GPU's NUMA
    /// node; IDs never collide, and IDs outside the split count are not ours.
    #[test]
    fn replicas_map_back_to_their_gpu(gpus in inventory(), split in 0u32..12) {
        let inv = Inventory::new(gpus.clone(), split);
        let devices = inv.kubelet_devices();
        prop_assert_eq!(devices.len(), gpus.len() * split.max(1) as usize);
        let mut ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        prop_assert_eq!(ids.len(), devices.len(), "replica IDs collide");
        for d in &devices {
            let g = inv.physical(&d.id).unwrap();
            prop_assert!(d.id.starts_with(&g.uuid));
            let numa = d.topology.as_ref().map(|t| t.nodes[0].id);
            prop_assert_eq!(numa, g.numa_node.map(i64::from));
        }
        for g in &gpus {
            let beyond = format!("{}-{}", g.uuid, split.max(1));
            let owner = inv.physical(&beyond).map(|o| o.uuid.clone());
            // A longer UUID of another GPU may legitimately own that spelling; ours never does.
            prop_assert_ne!(owner.as_deref(), Some(g.uuid.as_str()));
        }
    }
}
