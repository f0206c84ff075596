//! The cost side of the usage ledger (docs/usage.md): what a provider's reported usage costs at
//! the configured prices. Costs are computed when read, from the stored usage and the current
//! price table, so changing a price re-prices the ledger.

use crate::config::{Config, Price};
use crate::metrics::{self as metrics_names, AttemptMeters};
use crate::provider::Usage;

/// The first `[[prices]]` entry for `model` on `backend`.
pub(crate) fn price<'a>(
    config: &'a Config,
    backend: &str,
    model: Option<&str>,
) -> Option<&'a Price> {
    let model = model?;
    config.prices.iter().find(|p| p.matches(backend, model))
}

/// USD for `usage` at `price`: uncached input, cache reads and cache writes at their rates
/// (cache rates default to the input rate), the one-hour part of the cache writes at its own
/// (the other cache writes' rate when absent; RD-10, decision 103), output at the output rate.
/// `None` when the provider reported no tokens at all.
pub(crate) fn cost(price: &Price, usage: &Usage) -> Option<f64> {
    if usage.input_tokens.is_none() && usage.output_tokens.is_none() {
        return None;
    }
    let tokens = |n: Option<u64>| n.unwrap_or(0) as f64;
    let cached = tokens(usage.cached_input_tokens);
    let written = tokens(usage.cache_write_tokens);
    // Part of the writes: a count above them (a provider's error) is held to them.
    let written_1h = tokens(usage.cache_write_1h_tokens).min(written);
    let uncached = (tokens(usage.input_tokens) - cached - written).max(0.0);
    let write_rate = price.cache_write_per_mtok.unwrap_or(price.input_per_mtok);
    let usd = uncached * price.input_per_mtok
        + cached * price.cached_input_per_mtok.unwrap_or(price.input_per_mtok)
        + (written - written_1h) * write_rate
        + written_1h * price.cache_write_1h_per_mtok.unwrap_or(write_rate)
        + tokens(usage.output_tokens) * price.output_per_mtok;
    Some(usd / 1_000_000.0)
}

/// The `provider` label of `backend`'s series: its kind, empty for a backend no longer
/// configured.
fn provider_of(config: &Config, backend: &str) -> &'static str {
    config.backend(backend).map_or("", |b| b.kind.name())
}

/// `usage`'s token counts in the order of [`metrics_names::TOKEN_KINDS`].
fn token_counts(usage: &Usage) -> [Option<u64>; metrics_names::TOKEN_KINDS.len()] {
    [
        usage.input_tokens,
        usage.output_tokens,
        usage.cached_input_tokens,
        usage.cache_write_tokens,
        usage.reasoning_tokens,
        usage.cache_write_1h_tokens,
    ]
}

/// Adds `usage` to the token counter `name` of `backend` (of `provider`) and `model`, one series
/// per kind.
fn count_tokens(
    name: &'static str,
    provider: &'static str,
    backend: &str,
    model: &str,
    usage: &Usage,
) {
    for (kind, n) in metrics_names::TOKEN_KINDS
        .into_iter()
        .zip(token_counts(usage))
    {
        if let Some(n) = n {
            metrics::counter!(name, "provider" => provider, "backend" => backend.to_string(), "model" => model.to_string(), "kind" => kind)
                .increment(n);
        }
    }
}

/// Counts what an attempt of a request of `backend` and `model` reported it cost, into the
/// series `meters` keeps.
pub(crate) fn count_upstream(
    config: &Config,
    meters: &AttemptMeters,
    backend: &str,
    model: Option<&str>,
    usage: &Usage,
) {
    let counts = token_counts(usage);
    let usd = price(config, backend, model).and_then(|p| cost(p, usage));
    if counts.iter().all(Option::is_none) && usd.is_none() {
        // No series to count into: none is kept either.
        return;
    }
    let series = meters
        .backend(backend)
        .usage(provider_of(config, backend), model.unwrap_or(""));
    series.count_tokens(counts);
    if let Some(usd) = usd {
        // metrics counters count integers: a gauge that only grows carries the dollars.
        series.cost().increment(usd);
    }
}

/// Counts `calls` saved provider calls of a request of `backend` and `model`, and what they
/// would have cost (each the answering attempt's `usage`).
pub(crate) fn count_saved(
    config: &Config,
    backend: &str,
    model: Option<&str>,
    calls: u64,
    usage: &Usage,
) {
    let label = model.unwrap_or("");
    if calls == 0 {
        return;
    }
    let provider = provider_of(config, backend);
    metrics::counter!(metrics_names::SAVED_CALLS, "provider" => provider, "backend" => backend.to_string(), "model" => label.to_string())
        .increment(calls);
    let saved = usage.times(calls);
    count_tokens(
        metrics_names::SAVED_TOKENS,
        provider,
        backend,
        label,
        &saved,
    );
    if let Some(usd) = price(config, backend, model).and_then(|p| cost(p, &saved)) {
        metrics::gauge!(metrics_names::SAVED_COST_USD, "provider" => provider, "backend" => backend.to_string(), "model" => label.to_string())
            .increment(usd);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kind's count lands in its own `kind` series (`holdfast_upstream_tokens_total`), and
    /// a usage with no count and no price leaves no series (docs/usage.md).
    #[test]
    fn upstream_tokens_are_counted_under_their_own_kind() {
        let handle = crate::metrics::handle().expect("the recorder is installed");
        let config = Config {
            backends: vec![crate::config::Backend {
                name: "kinds-backend".into(),
                kind: crate::provider::Provider::Anthropic,
                base_url: "http://127.0.0.1:9/v1".into(),
                api_key_env: None,
            }],
            ..Config::default()
        };
        let meters = AttemptMeters::default();
        let usage = Usage {
            input_tokens: Some(101),
            output_tokens: Some(102),
            cached_input_tokens: Some(103),
            cache_write_tokens: Some(104),
            reasoning_tokens: Some(105),
            cache_write_1h_tokens: Some(106),
        };
        count_upstream(
            &config,
            &meters,
            "kinds-backend",
            Some("kinds-model"),
            &usage,
        );
        count_upstream(
            &config,
            &meters,
            "kinds-backend",
            Some("no-usage"),
            &Usage::default(),
        );
        let rendered = handle.render();
        for (kind, n) in [
            ("input", 101),
            ("output", 102),
            ("cached_input", 103),
            ("cache_write", 104),
            ("reasoning", 105),
            ("cache_write_1h", 106),
        ] {
            let line = format!(
                "holdfast_upstream_tokens_total{{provider=\"anthropic\",backend=\"kinds-backend\",model=\"kinds-model\",kind=\"{kind}\"}} {n}"
            );
            assert!(rendered.contains(&line), "{line} in {rendered}");
        }
        assert!(!rendered.contains("no-usage"), "{rendered}");
    }

    fn price() -> Price {
        Price {
            backend: "openai".into(),
            model: "gpt-4o-mini*".into(),
            input_per_mtok: 0.15,
            output_per_mtok: 0.60,
            cached_input_per_mtok: Some(0.075),
            cache_write_per_mtok: None,
            cache_write_1h_per_mtok: None,
        }
    }

    #[test]
    fn cost_prices_uncached_cached_written_and_output_tokens_at_their_rates() {
        let usage = Usage {
            input_tokens: Some(1_000_000),
            output_tokens: Some(500_000),
            cached_input_tokens: Some(400_000),
            cache_write_tokens: Some(100_000),
            reasoning_tokens: Some(1),
            cache_write_1h_tokens: None,
        };
        // 500k uncached at 0.15, 400k cached at 0.075, 100k written at 0.15, 500k out at 0.60.
        let expected = 0.5 * 0.15 + 0.4 * 0.075 + 0.1 * 0.15 + 0.5 * 0.60;
        let got = cost(&price(), &usage).unwrap();
        assert!((got - expected).abs() < 1e-12, "{got} != {expected}");
        assert_eq!(cost(&price(), &Usage::default()), None);
        assert!(price().matches("openai", "gpt-4o-mini-2024-07-18"));
        assert!(!price().matches("other", "gpt-4o-mini"));
    }

    /// Anthropic bills a one-hour cache write at twice the input price, a five-minute one at
    /// 1.25 times: the one-hour part of the writes is priced at `cache_write_1h_per_mtok`, the
    /// rest at `cache_write_per_mtok`; without the one-hour price, all of them at the latter,
    /// as before; without either, at the input price.
    #[test]
    fn one_hour_cache_writes_are_priced_at_their_own_rate_rd10() {
        let claude = Price {
            backend: "anthropic".into(),
            model: "claude-sonnet-4*".into(),
            input_per_mtok: 3.0,
            output_per_mtok: 15.0,
            cached_input_per_mtok: Some(0.30),
            cache_write_per_mtok: Some(3.75),
            cache_write_1h_per_mtok: Some(6.0),
        };
        let usage = Usage {
            input_tokens: Some(1_000_000 + 300_000 + 200_000 + 100_000),
            output_tokens: Some(10_000),
            cached_input_tokens: Some(200_000),
            cache_write_tokens: Some(300_000 + 100_000),
            cache_write_1h_tokens: Some(100_000),
            reasoning_tokens: None,
        };
        let close = |got: Option<f64>, expected: f64| {
            let got = got.expect("a cost");
            assert!((got - expected).abs() < 1e-12, "{got} != {expected}");
        };
        // 1M uncached at 3, 200k read at 0.30, 300k 5m writes at 3.75, 100k 1h writes at 6,
        // 10k out at 15.
        let base = 1.0 * 3.0 + 0.2 * 0.30 + 0.01 * 15.0;
        close(cost(&claude, &usage), base + 0.3 * 3.75 + 0.1 * 6.0);
        // Not reported: every write at the five-minute rate.
        let unsplit = Usage {
            cache_write_1h_tokens: None,
            ..usage
        };
        close(cost(&claude, &unsplit), base + 0.4 * 3.75);
        // No one-hour price: the cache-write price, then the input price.
        let no_1h = Price {
            cache_write_1h_per_mtok: None,
            ..claude.clone()
        };
        close(cost(&no_1h, &usage), base + 0.4 * 3.75);
        let no_write = Price {
            cache_write_per_mtok: None,
            cache_write_1h_per_mtok: None,
            ..claude.clone()
        };
        close(cost(&no_write, &usage), base + 0.4 * 3.0);
        // A one-hour count above the writes is held to them.
        let over = Usage {
            cache_write_1h_tokens: Some(900_000),
            ..usage
        };
        close(cost(&claude, &over), base + 0.4 * 6.0);
    }
}
