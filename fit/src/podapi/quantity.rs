//! Just enough of the Kubernetes quantity grammar to read the integer amounts of the pod API
//! (`"1"`, `"4096"`, `"4Ki"`, `"1e3"`, `"2000m"`), the way HAMi reads them with
//! `Quantity.AsInt64()`: the value must be a whole number that fits in an `i64`.

/// Why a quantity was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantityError {
    /// Not a Kubernetes quantity at all.
    Malformed,
    /// A quantity, but not a whole number (e.g. `1.5`, `500m`).
    NotInteger,
    /// A whole number, but larger than the API accepts.
    TooLarge,
}

impl QuantityError {
    /// Short explanation for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            QuantityError::Malformed => "not a Kubernetes quantity",
            QuantityError::NotInteger => "not a whole number",
            QuantityError::TooLarge => "too large",
        }
    }
}

/// Parses `raw` as a Kubernetes quantity whose value is an integer.
pub fn parse_integer(raw: &str) -> Result<i64, QuantityError> {
    let s = raw.trim();
    let (negative, s) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let number_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(number_end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(QuantityError::Malformed);
    }
    // Long digit strings would overflow the exact arithmetic below; no sane amount needs them.
    if whole.len() + fraction.len() > 30 {
        return Err(QuantityError::TooLarge);
    }
    let mut mantissa: i128 = 0;
    for b in whole.bytes().chain(fraction.bytes()) {
        mantissa = mantissa * 10 + i128::from(b - b'0');
    }
    // value = mantissa * 10^(exp10 - fraction digits) * 2^exp2
    let (exp10, exp2) = suffix_exponents(suffix).ok_or(QuantityError::Malformed)?;
    let exp10 = exp10 - fraction.len() as i32;
    let mut value = mantissa;
    if exp10 >= 0 {
        for _ in 0..exp10 {
            value = value.checked_mul(10).ok_or(QuantityError::TooLarge)?;
        }
    } else {
        for _ in 0..(-exp10) {
            if value % 10 != 0 {
                return Err(QuantityError::NotInteger);
            }
            value /= 10;
        }
    }
    value = value
        .checked_mul(1i128 << exp2)
        .ok_or(QuantityError::TooLarge)?;
    if negative {
        value = -value;
    }
    i64::try_from(value).map_err(|_| QuantityError::TooLarge)
}

/// Decimal and binary exponents of a quantity suffix; `None` for an unknown suffix.
fn suffix_exponents(suffix: &str) -> Option<(i32, u32)> {
    let decimal = |e: i32| Some((e, 0));
    let binary = |e: u32| Some((0, e));
    match suffix {
        "" => decimal(0),
        "m" => decimal(-3),
        "k" => decimal(3),
        "M" => decimal(6),
        "G" => decimal(9),
        "T" => decimal(12),
        "P" => decimal(15),
        "E" => decimal(18),
        "Ki" => binary(10),
        "Mi" => binary(20),
        "Gi" => binary(30),
        "Ti" => binary(40),
        "Pi" => binary(50),
        "Ei" => binary(60),
        _ => {
            // Scientific notation: `e<int>` or `E<int>`.
            let rest = suffix.strip_prefix(['e', 'E'])?;
            let digits = rest.strip_prefix(['+', '-']).unwrap_or(rest);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let e: i32 = rest.parse().ok()?;
            (-40..=40).contains(&e).then_some((e, 0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_plain_suffixed_and_scientific_integers() {
        for (raw, want) in [
            ("1", 1),
            (" 4096 ", 4096),
            ("+7", 7),
            ("0", 0),
            ("-3", -3),
            ("2k", 2000),
            ("1Ki", 1024),
            ("3Mi", 3 << 20),
            ("1e3", 1000),
            ("1E3", 1000),
            ("2000m", 2),
            ("1.5k", 1500),
            ("10.0", 10),
            ("1E", 1_000_000_000_000_000_000),
        ] {
            assert_eq!(parse_integer(raw), Ok(want), "{raw:?}");
        }
    }

    #[test]
    fn refuses_fractions_garbage_and_overflow() {
        for (raw, want) in [
            ("1.5", QuantityError::NotInteger),
            ("500m", QuantityError::NotInteger),
            ("", QuantityError::Malformed),
            ("abc", QuantityError::Malformed),
            ("1x", QuantityError::Malformed),
            ("1.2.3", QuantityError::Malformed),
            (".", QuantityError::Malformed),
            ("1e", QuantityError::Malformed),
            ("9Ei", QuantityError::TooLarge),
            ("99999999999999999999", QuantityError::TooLarge),
        ] {
            assert_eq!(parse_integer(raw), Err(want), "{raw:?}");
        }
    }
}
