//! What a run cost, estimated from its tokens and the price table kept in the repository
//! (`prices.toml`, with its date and sources), for the summary line.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// One model's prices.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// US dollars per million prompt tokens.
    pub input: f64,
    /// US dollars per million output tokens.
    pub output: f64,
    /// Share of the online price that batch jobs cost.
    pub batch: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    models: BTreeMap<String, Price>,
}

/// The table compiled into weir.
const PRICES: &str = include_str!("prices.toml");

fn table() -> &'static BTreeMap<String, Price> {
    static TABLE: OnceLock<BTreeMap<String, Price>> = OnceLock::new();
    TABLE.get_or_init(|| toml::from_str::<Table>(PRICES).map(|t| t.models).expect("prices.toml is valid"))
}

/// The price of `model` (`provider/name` or a bare name): its own, or a listed name's that it
/// extends with a version (`-2024-07-18`, `-001`, `-latest`), so that dated versions take
/// their family's price while other models of a family (`-lite`, `-realtime`, `-preview-tts`)
/// get none rather than a wrong one.
pub fn price_of(model: &str) -> Option<(&'static str, Price)> {
    let name = model.split_once('/').map_or(model, |(_, n)| n);
    let name = name.rsplit('/').next().unwrap_or(name);
    table()
        .iter()
        .filter(|(k, _)| {
            name == k.as_str()
                || name
                    .strip_prefix(k.as_str())
                    .and_then(|rest| rest.strip_prefix('-'))
                    .is_some_and(|v| v == "latest" || v.starts_with(|c: char| c.is_ascii_digit()))
        })
        .max_by_key(|(k, _)| k.len())
        .map(|(k, p)| (k.as_str(), *p))
}

/// Estimated cost of a run's tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Cost {
    /// The table's name for the model.
    pub model: &'static str,
    /// Its prices.
    pub price: Price,
    /// US dollars at the price the run paid (batch price for tokens answered by batch jobs).
    pub usd: f64,
    /// What the same tokens cost online, when some were answered by batch jobs.
    pub online_usd: Option<f64>,
}

impl Cost {
    /// The cost of `online` (prompt, output) tokens answered by online calls and `batch` tokens
    /// answered by jobs; `None` for a model without a price.
    pub fn estimate(model: &str, online: (u64, u64), batch: (u64, u64)) -> Option<Self> {
        let (name, price) = price_of(model)?;
        let at = |(i, o): (u64, u64)| (i as f64 * price.input + o as f64 * price.output) / 1e6;
        let usd = at(online) + at(batch) * price.batch;
        let online_usd = (batch != (0, 0)).then(|| at(online) + at(batch));
        Some(Self { model: name, price, usd, online_usd })
    }

    /// The summary line.
    pub fn line(&self) -> String {
        let mut s = format!(
            "  cost: about ${} ({} at ${}/${} per 1M tokens in/out",
            dollars(self.usd),
            self.model,
            self.price.input,
            self.price.output
        );
        if let Some(online) = self.online_usd {
            s.push_str(&format!(
                "; batch jobs at {:.0} % of that: online, the same run would cost ${}",
                self.price.batch * 100.0,
                dollars(online)
            ));
        }
        s.push_str("; prices as dated in prices.toml)\n");
        s
    }
}

/// Dollars with as many decimals as a small amount needs.
pub fn dollars(usd: f64) -> String {
    if usd == 0.0 {
        "0".into()
    } else if usd >= 1.0 {
        format!("{usd:.2}")
    } else if usd >= 0.01 {
        format!("{usd:.4}")
    } else {
        format!("{usd:.6}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_reads_and_names_match_families() {
        assert_eq!(price_of("gemini/gemini-2.5-flash").unwrap().0, "gemini-2.5-flash");
        assert_eq!(price_of("vertex_ai/gemini-2.5-flash-lite").unwrap().0, "gemini-2.5-flash-lite");
        assert_eq!(price_of("openai/gpt-4o-mini-2024-07-18").unwrap().0, "gpt-4o-mini");
        assert_eq!(price_of("openai/gpt-4o").unwrap().0, "gpt-4o");
        assert!(price_of("sim/demo").is_none());
        assert!(price_of("openai/gpt-4odd").is_none());
        assert!(price_of("openai/meta-llama/Llama-3.1-8B").is_none());
        // Another model of a family is not priced as the family (a hostile helper's finding).
        assert!(price_of("gemini/gemini-2.0-flash-lite").is_none());
        assert!(price_of("openai/gpt-4o-mini-realtime").is_none());
        assert!(price_of("gemini/gemini-2.5-pro-preview-tts").is_none());
        assert_eq!(price_of("gemini/gemini-2.5-flash-001").unwrap().0, "gemini-2.5-flash");
        assert_eq!(price_of("openai/gpt-4o-latest").unwrap().0, "gpt-4o");
    }

    #[test]
    fn batch_tokens_cost_the_batch_share() {
        let p = price_of("gemini-2.5-flash").unwrap().1;
        let c = Cost::estimate("gemini/gemini-2.5-flash", (0, 0), (1_000_000, 1_000_000)).unwrap();
        assert!((c.usd - (p.input + p.output) * p.batch).abs() < 1e-9);
        assert!((c.online_usd.unwrap() - (p.input + p.output)).abs() < 1e-9);
        let online = Cost::estimate("gemini/gemini-2.5-flash", (2_000_000, 0), (0, 0)).unwrap();
        assert!((online.usd - 2.0 * p.input).abs() < 1e-9);
        assert_eq!(online.online_usd, None);
        assert!(online.line().contains(&format!("${}", dollars(2.0 * p.input))));
    }
}
