//! Human units in cluster files: sizes (`24 GiB`, `512 MB`), bandwidths (`936 GB/s`,
//! `1 Gbit/s`), compute rates (`71 TFLOPS`), times (`0.5 ms`, `10 us`). Values come back in base
//! units: bytes, bytes per second, flop per second, seconds.

use crate::PlanError;

fn split(s: &str) -> Option<(f64, String)> {
    let t = s.trim();
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E' || c == '-' || c == '+'))
        .unwrap_or(t.len());
    // an exponent's `e` must be followed by digits; "1 ms" keeps "ms" whole
    let (num, unit) = t.split_at(end);
    let v: f64 = num.trim().parse().ok()?;
    Some((v, unit.trim().to_string()))
}

fn bad(what: &str, s: &str, expected: &str) -> PlanError {
    PlanError::BadUnit { what: what.to_string(), value: s.to_string(), expected: expected.to_string() }
}

fn positive(what: &str, s: &str, v: f64) -> Result<f64, PlanError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(PlanError::BadValue { what: what.to_string(), value: s.to_string(), why: "must be positive".into() })
    }
}

/// Bytes: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024).
pub fn bytes(what: &str, s: &str) -> Result<u64, PlanError> {
    const EXPECT: &str = "a size such as `24 GiB`, `512 MB` or `1000 B`";
    let (v, unit) = split(s).ok_or_else(|| bad(what, s, EXPECT))?;
    let m = match unit.as_str() {
        "B" | "" => 1.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(bad(what, s, EXPECT)),
    };
    let b = positive(what, s, v * m)?;
    if b > 1e18 {
        return Err(PlanError::BadValue { what: what.into(), value: s.into(), why: "implausibly large".into() });
    }
    Ok(b as u64)
}

/// Bytes per second: B/s, KB/s … TB/s, KiB/s … GiB/s, and bits: Kbit/s, Mbit/s, Gbit/s, Tbit/s
/// (also Kbps, Mbps, Gbps).
pub fn bandwidth(what: &str, s: &str) -> Result<f64, PlanError> {
    const EXPECT: &str = "a bandwidth such as `936 GB/s`, `25 GiB/s` or `1 Gbit/s`";
    let (v, unit) = split(s).ok_or_else(|| bad(what, s, EXPECT))?;
    let m = match unit.as_str() {
        "B/s" => 1.0,
        "KB/s" | "kB/s" => 1e3,
        "MB/s" => 1e6,
        "GB/s" => 1e9,
        "TB/s" => 1e12,
        "KiB/s" => 1024.0,
        "MiB/s" => 1024.0 * 1024.0,
        "GiB/s" => 1024.0 * 1024.0 * 1024.0,
        "bit/s" | "bps" => 1.0 / 8.0,
        "Kbit/s" | "kbit/s" | "Kbps" | "kbps" => 1e3 / 8.0,
        "Mbit/s" | "Mbps" => 1e6 / 8.0,
        "Gbit/s" | "Gbps" => 1e9 / 8.0,
        "Tbit/s" | "Tbps" => 1e12 / 8.0,
        _ => return Err(bad(what, s, EXPECT)),
    };
    positive(what, s, v * m)
}

/// Floating-point operations per second: FLOPS, KFLOPS … PFLOPS.
pub fn flops(what: &str, s: &str) -> Result<f64, PlanError> {
    const EXPECT: &str = "a compute rate such as `71 TFLOPS` or `500 GFLOPS`";
    let (v, unit) = split(s).ok_or_else(|| bad(what, s, EXPECT))?;
    let m = match unit.to_ascii_uppercase().as_str() {
        "FLOPS" => 1.0,
        "KFLOPS" => 1e3,
        "MFLOPS" => 1e6,
        "GFLOPS" => 1e9,
        "TFLOPS" => 1e12,
        "PFLOPS" => 1e15,
        _ => return Err(bad(what, s, EXPECT)),
    };
    positive(what, s, v * m)
}

/// Seconds: s, ms, us (µs), ns. Zero is allowed (an ideal link).
pub fn seconds(what: &str, s: &str) -> Result<f64, PlanError> {
    const EXPECT: &str = "a time such as `0.5 ms`, `10 us` or `2 s`";
    let (v, unit) = split(s).ok_or_else(|| bad(what, s, EXPECT))?;
    let m = match unit.as_str() {
        "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        _ => return Err(bad(what, s, EXPECT)),
    };
    let t = v * m;
    if !(t.is_finite() && t >= 0.0) {
        return Err(PlanError::BadValue { what: what.into(), value: s.into(), why: "must not be negative".into() });
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(bytes("m", "24 GiB").unwrap(), 24 << 30);
        assert_eq!(bytes("m", "1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(bytes("m", "4096 B").unwrap(), 4096);
        assert!((bandwidth("b", "1 Gbit/s").unwrap() - 125e6).abs() < 1e-6);
        assert!((bandwidth("b", "936 GB/s").unwrap() - 936e9).abs() < 1.0);
        assert!((flops("f", "71 TFLOPS").unwrap() - 71e12).abs() < 1.0);
        assert!((seconds("t", "0.5 ms").unwrap() - 5e-4).abs() < 1e-12);
        assert!((seconds("t", "10 us").unwrap() - 1e-5).abs() < 1e-12);
        assert_eq!(seconds("t", "0 ms").unwrap(), 0.0);
    }

    #[test]
    fn rejects_bad_units_and_values() {
        for s in ["24 gigs", "GiB", "", "12 parsecs", "1e999 GB"] {
            assert!(bytes("m", s).is_err(), "{s}");
        }
        assert!(bytes("m", "-1 GiB").is_err());
        assert!(bytes("m", "0 GiB").is_err());
        assert!(bandwidth("b", "0 GB/s").is_err());
        assert!(bandwidth("b", "-3 Gbit/s").is_err());
        assert!(bandwidth("b", "3 GHz").is_err());
        assert!(flops("f", "7 TOPS").is_err());
        assert!(seconds("t", "-1 ms").is_err());
        assert!(seconds("t", "3 fortnights").is_err());
        let e = bytes("node `a` device `gpu` memory", "24 gigs").unwrap_err().to_string();
        assert!(e.contains("24 gigs") && e.contains("GiB"), "{e}");
    }
}
