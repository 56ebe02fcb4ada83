//! The one grammar of every duration flag of every gpuledger binary: humantime's (`500ms`,
//! `2s`, `5m`, `1h 30m`, `10 minutes`), and a bare number as seconds (`7`, `0.25`), which the
//! device plugin has always accepted.

use std::time::Duration;

/// A flag value that is not a duration.
#[derive(Debug, thiserror::Error)]
#[error("invalid duration {raw:?}: expected a number with a unit, e.g. 500ms, 2s, 5m ({reason})")]
pub struct DurationError {
    raw: String,
    reason: String,
}

/// Parses a duration flag.
pub fn parse_duration(raw: &str) -> Result<Duration, DurationError> {
    let s = raw.trim();
    let bad = |reason: String| DurationError {
        raw: raw.to_string(),
        reason,
    };
    if let Ok(seconds) = s.parse::<f64>() {
        if !seconds.is_finite() || seconds < 0.0 {
            return Err(bad("not a non-negative number of seconds".into()));
        }
        return Duration::try_from_secs_f64(seconds).map_err(|e| bad(e.to_string()));
    }
    humantime::parse_duration(s).map_err(|e| bad(e.to_string()))
}

/// Parses a duration flag that paces a loop or bounds a wait, where zero would mean a loop
/// with no pause (or a timer that cannot be built) or a wait that always fails at once.
pub fn parse_positive_duration(raw: &str) -> Result<Duration, DurationError> {
    let period = parse_duration(raw)?;
    if period.is_zero() {
        return Err(DurationError {
            raw: raw.to_string(),
            reason: "must be above zero".into(),
        });
    }
    Ok(period)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_bare_seconds_and_refusals() {
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1h 30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration(" 2s ").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert_eq!(parse_duration("0.25").unwrap(), Duration::from_millis(250));
        for bad in ["", "m", "-1", "-2s", "2x", "NaN", "inf", "1e400"] {
            let e = parse_duration(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn a_period_refuses_zero_in_every_spelling() {
        assert_eq!(
            parse_positive_duration("1ms").unwrap(),
            Duration::from_millis(1)
        );
        assert_eq!(
            parse_positive_duration("0.5").unwrap(),
            Duration::from_millis(500)
        );
        for zero in ["0", "0s", "0ms", "0.0", "0 minutes"] {
            let e = parse_positive_duration(zero).unwrap_err().to_string();
            assert!(
                e.contains("above zero") && e.contains(&format!("{zero:?}")),
                "{e}"
            );
            assert_eq!(parse_duration(zero).unwrap(), Duration::ZERO);
        }
    }
}
