//! A pod's UID as the pod cache keeps it: the 16 bytes of the UUID the API server gives every
//! pod, instead of its 36 characters of text.
//!
//! The cache holds one per pod of the cluster (100 000 in a large one). As a `String` each was
//! 24 bytes in the facts and a 48-byte heap chunk for the text; as bytes it is 24 in all. A UID
//! that is not a UUID in the API server's canonical form (lowercase hex, four dashes) is kept
//! as its text, so every UID compares exactly as its text would.

use std::fmt;

/// A pod's `metadata.uid`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PodUid {
    /// A canonical UUID, as bytes.
    Uuid([u8; 16]),
    /// Anything else, as given.
    Text(Box<str>),
}

/// Where the dashes of a canonical UUID are.
const DASHES: [usize; 4] = [8, 13, 18, 23];

impl PodUid {
    /// The UID of text `uid`.
    pub fn new(uid: &str) -> Self {
        match uuid_bytes(uid) {
            Some(bytes) => PodUid::Uuid(bytes),
            None => PodUid::Text(uid.into()),
        }
    }

    /// Whether this is the UID whose text is `uid` (as a reservation's `spec.podUID` names it).
    pub fn is(&self, uid: &str) -> bool {
        match self {
            PodUid::Uuid(bytes) => uuid_bytes(uid).is_some_and(|other| other == *bytes),
            PodUid::Text(text) => **text == *uid,
        }
    }
}

/// No UID (a pod as the API server never returns one): compares equal to the empty text only.
impl Default for PodUid {
    fn default() -> Self {
        PodUid::Text(Box::default())
    }
}

impl From<&str> for PodUid {
    fn from(uid: &str) -> Self {
        Self::new(uid)
    }
}

impl fmt::Display for PodUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PodUid::Uuid(bytes) => {
                for (i, byte) in bytes.iter().enumerate() {
                    // Groups of 4, 2, 2, 2 and 6 bytes.
                    if matches!(i, 4 | 6 | 8 | 10) {
                        f.write_str("-")?;
                    }
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
            PodUid::Text(text) => f.write_str(text),
        }
    }
}

/// The bytes of `uid` if it is a UUID in canonical form: 36 characters, dashes at
/// [`DASHES`], lowercase hex digits everywhere else.
fn uuid_bytes(uid: &str) -> Option<[u8; 16]> {
    let text = uid.as_bytes();
    if text.len() != 36 || DASHES.iter().any(|&at| text[at] != b'-') {
        return None;
    }
    let mut digits = text.iter().filter(|&&c| c != b'-');
    let mut bytes = [0u8; 16];
    for byte in &mut bytes {
        let high = hex_digit(*digits.next()?)?;
        let low = hex_digit(*digits.next()?)?;
        *byte = (high << 4) | low;
    }
    Some(bytes)
}

/// The value of a lowercase hex digit.
fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f8e2c1a-93b4-4d7e-a5c6-1b2d3e4f5a6b";

    #[test]
    fn a_canonical_uuid_is_kept_as_bytes_and_reads_back_the_same() {
        let uid = PodUid::new(UID);
        assert!(matches!(uid, PodUid::Uuid(_)), "{uid:?}");
        assert_eq!(uid.to_string(), UID);
        assert!(uid.is(UID));
        assert_eq!(std::mem::size_of::<PodUid>(), 24);
    }

    #[test]
    fn anything_else_is_kept_as_text_and_compares_as_text() {
        // Uppercase, no dashes, a dash moved, a non-hex digit, too short: not canonical.
        for other in [
            "0F8E2C1A-93B4-4D7E-A5C6-1B2D3E4F5A6B",
            "0f8e2c1a93b44d7ea5c61b2d3e4f5a6b",
            "0f8e2c1-a93b4-4d7e-a5c6-1b2d3e4f5a6b",
            "0f8e2c1a-93b4-4d7e-a5c6-1b2d3e4f5a6g",
            "u1",
            "",
        ] {
            let uid = PodUid::new(other);
            assert_eq!(uid, PodUid::Text(other.into()), "{other}");
            assert_eq!(uid.to_string(), other);
            assert!(uid.is(other), "{other}");
            assert!(!uid.is(UID), "{other}");
            assert!(!PodUid::new(UID).is(other), "{other}");
        }
    }

    #[test]
    fn uuids_differing_in_one_digit_differ() {
        let uid = PodUid::new(UID);
        for at in (0..36).filter(|i| !DASHES.contains(i)) {
            let mut other = UID.as_bytes().to_vec();
            other[at] = if other[at] == b'0' { b'1' } else { b'0' };
            let other = String::from_utf8(other).unwrap();
            assert!(!uid.is(&other), "{other}");
            assert_ne!(uid, PodUid::new(&other), "{other}");
        }
    }
}
