//! NUMA node of a PCI device, read from sysfs.
//!
//! The kernel exposes `<sysfs>/bus/pci/devices/<domain:bus:device.function>/numa_node`; it holds
//! `-1` when the platform has no NUMA information (single-socket machines, most VMs).

use std::path::Path;

/// Normalizes a PCI bus id to the kernel's sysfs form `dddd:bb:dd.f` in lower case.
///
/// NVML reports `00000000:3B:00.0` (an 8-digit domain); sysfs names the directory
/// `0000:3b:00.0`. A 4-digit domain or a missing domain (`3b:00.0`) are accepted too.
pub fn normalize_bus_id(raw: &str) -> Option<String> {
    let raw = raw.trim().to_ascii_lowercase();
    let (domain, rest) = match raw.matches(':').count() {
        1 => ("0", raw.as_str()),
        2 => raw.split_once(':')?,
        _ => return None,
    };
    let (bus, devfn) = rest.split_once(':')?;
    let (device, function) = devfn.split_once('.')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let device = u8::from_str_radix(device, 16).ok()?;
    let function = u8::from_str_radix(function, 16).ok()?;
    if domain > 0xffff || device > 0x1f || function > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// The NUMA node of the PCI device `bus_id` under `sysfs_root` (normally `/sys`).
///
/// `None` when the id cannot be parsed, the file is missing or unreadable, or it holds a
/// negative number: the device then advertises no topology rather than a wrong one.
pub fn numa_node(sysfs_root: &Path, bus_id: &str) -> Option<u32> {
    let dir = normalize_bus_id(bus_id)?;
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(dir)
        .join("numa_node");
    let text = std::fs::read_to_string(path).ok()?;
    let value: i64 = text.trim().parse().ok()?;
    u32::try_from(value).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_nvml_and_sysfs_forms() {
        assert_eq!(
            normalize_bus_id("00000000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            normalize_bus_id("0000:3b:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(normalize_bus_id("3B:00.1").as_deref(), Some("0000:3b:00.1"));
        assert_eq!(
            normalize_bus_id("00000001:AF:1F.7").as_deref(),
            Some("0001:af:1f.7")
        );
    }

    #[test]
    fn rejects_malformed_bus_ids() {
        for bad in [
            "",
            "3b",
            "0000:3b:00",
            "0000:zz:00.0",
            "0000:3b:20.0",
            "0000:3b:00.8",
            "1:2:3:4.0",
        ] {
            assert_eq!(normalize_bus_id(bad), None, "{bad:?}");
        }
    }

    fn fake_sysfs(entries: &[(&str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (dev, numa) in entries {
            let dir = root.path().join("bus/pci/devices").join(dev);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("numa_node"), numa).unwrap();
        }
        root
    }

    #[test]
    fn reads_numa_from_a_fake_sysfs_tree() {
        let root = fake_sysfs(&[
            ("0000:3b:00.0", "0\n"),
            ("0000:af:00.0", "1\n"),
            ("0000:18:00.0", "-1\n"),
            ("0000:19:00.0", "garbage\n"),
        ]);
        assert_eq!(numa_node(root.path(), "00000000:3B:00.0"), Some(0));
        assert_eq!(numa_node(root.path(), "00000000:AF:00.0"), Some(1));
        assert_eq!(
            numa_node(root.path(), "00000000:18:00.0"),
            None,
            "-1 means unknown"
        );
        assert_eq!(
            numa_node(root.path(), "00000000:19:00.0"),
            None,
            "unparsable"
        );
        assert_eq!(
            numa_node(root.path(), "00000000:86:00.0"),
            None,
            "missing device"
        );
        assert_eq!(numa_node(root.path(), "not-a-bus-id"), None);
    }
}
