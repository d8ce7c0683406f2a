//! Human sizes ("64GiB", "512KiB", "1.5GB", "4096") and durations ("2s",
//! "250ms", "1m"), as written in config files and on the command line.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// A size in bytes that parses and prints in human units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let num: f64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a size: expected e.g. 64GiB, 512KiB or 4096"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1000,
            "kib" => 1 << 10,
            "m" | "mb" => 1000 * 1000,
            "mib" => 1 << 20,
            "g" | "gb" => 1000 * 1000 * 1000,
            "gib" => 1 << 30,
            "t" | "tb" => 1000 * 1000 * 1000 * 1000,
            "tib" => 1 << 40,
            other => return Err(format!("unknown size unit {other:?} in {s:?}")),
        };
        let bytes = num * mult as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(format!("size {s:?} is out of range"));
        }
        Ok(ByteSize(bytes.round() as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut v = self.0 as f64;
        let mut i = 0;
        while v >= 1024.0 && i + 1 < UNITS.len() {
            v /= 1024.0;
            i += 1;
        }
        if i == 0 {
            write!(f, "{}B", self.0)
        } else if v.fract() == 0.0 {
            write!(f, "{v:.0}{}", UNITS[i])
        } else {
            write!(f, "{v:.1}{}", UNITS[i])
        }
    }
}

/// A duration that parses and prints as "2s" or "250ms" (in configs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

impl FromStr for HumanDuration {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_duration(s).map(HumanDuration)
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_duration(self.0))
    }
}

#[cfg(feature = "serde")]
mod serde_impls {
    use super::{ByteSize, HumanDuration};
    use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

    impl Serialize for ByteSize {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(&self.to_string())
        }
    }

    impl<'de> Deserialize<'de> for ByteSize {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            #[derive(Deserialize)]
            #[serde(untagged)]
            enum Raw {
                Int(u64),
                Text(String),
            }
            match Raw::deserialize(d)? {
                Raw::Int(n) => Ok(ByteSize(n)),
                Raw::Text(s) => s.parse().map_err(de::Error::custom),
            }
        }
    }

    impl Serialize for HumanDuration {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(&self.to_string())
        }
    }

    impl<'de> Deserialize<'de> for HumanDuration {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            String::deserialize(d)?.parse().map_err(de::Error::custom)
        }
    }
}

/// Parses "250ms", "2s", "1.5s", "3m", "1h".
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration: expected e.g. 2s or 250ms"))?;
    let secs = match unit.trim() {
        "ms" => num / 1000.0,
        "s" | "" => num,
        "m" => num * 60.0,
        "h" => num * 3600.0,
        other => return Err(format!("unknown duration unit {other:?} in {s:?}")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("duration {s:?}: {e}"))
}

/// Formats a duration the way `parse_duration` reads it.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        assert_eq!("64GiB".parse::<ByteSize>().unwrap().0, 64 << 30);
        assert_eq!("512 KiB".parse::<ByteSize>().unwrap().0, 512 << 10);
        assert_eq!("1.5GB".parse::<ByteSize>().unwrap().0, 1_500_000_000);
        assert_eq!("4096".parse::<ByteSize>().unwrap().0, 4096);
        assert!("12 parsecs".parse::<ByteSize>().is_err());
        assert!("GiB".parse::<ByteSize>().is_err());
        assert_eq!(ByteSize(1 << 30).to_string(), "1GiB");
        assert_eq!(ByteSize(1536).to_string(), "1.5KiB");
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert!(parse_duration("soon").is_err());
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
    }
}
