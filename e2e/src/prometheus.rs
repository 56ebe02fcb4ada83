//! Reading figures out of a Prometheus text exposition (what `/metrics` serves), for tests
//! that check what a component exports.

/// The sum of every series of metric `name` whose labels include each of `labels` (e.g.
/// `outcome="in_flight"`); `None` when no series of it is exported at all.
pub fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(|a, b| a + b)
}

/// [`sample`], 0 when nothing of `name` is exported (a counter not yet touched).
pub fn sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    sample(text, name, labels).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_the_series_that_carry_every_label_and_tells_absent_from_zero() {
        let text = "# HELP x_total X\n\
                    x_total{outcome=\"a\",node=\"n1\"} 2\n\
                    x_total{outcome=\"a\",node=\"n2\"} 3\n\
                    x_total{outcome=\"b\"} 7\n\
                    x_total_extra 100\n\
                    y 0\n";
        assert_eq!(sample(text, "x_total", &["outcome=\"a\""]), Some(5.0));
        assert_eq!(sample(text, "x_total", &[]), Some(12.0));
        assert_eq!(sample(text, "y", &[]), Some(0.0));
        assert_eq!(sample(text, "z", &[]), None);
        assert_eq!(sum(text, "z", &[]), 0.0);
    }
}
