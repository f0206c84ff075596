//! Where a callback may go (SPEC CB-2, CB-5): the URL's shape at admission, the refused
//! address ranges, and the resolver that drops refused addresses at send time, so the check
//! holds for the address actually connected to (no second lookup an attacker's DNS could
//! answer differently).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// Longest callback URL accepted (CB-2).
pub(crate) const MAX_URL_BYTES: usize = 2048;

/// Networks `[callbacks] allow` admits although they are in a refused range.
#[derive(Debug, Clone, Default)]
pub(crate) struct Allow(Arc<Vec<IpNet>>);

impl Allow {
    /// The allow-list of `[callbacks] allow`; entries that do not parse (config validation
    /// refuses them) are left out.
    pub(crate) fn new(entries: &[String]) -> Allow {
        let nets = entries
            .iter()
            .filter_map(|e| {
                e.parse::<IpNet>()
                    .ok()
                    .or_else(|| e.parse::<IpAddr>().ok().map(IpNet::from))
            })
            .collect();
        Allow(Arc::new(nets))
    }

    /// Whether a callback may connect to `ip`: outside every refused range, or admitted.
    pub(crate) fn permits(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        !refused(ip) || self.0.iter().any(|net| net.contains(&ip))
    }
}

/// Whether `ip` is in a range callbacks may not reach by default (CB-2): loopback, private,
/// link-local (the metadata address among them), unspecified, shared, reserved, multicast,
/// broadcast. IPv4-mapped IPv6 addresses are judged as their IPv4 address.
pub(crate) fn refused(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => refused_v6(v6),
    }
}

fn refused_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        || (a == 100 && (64..128).contains(&b)) // shared address space, 100.64.0.0/10
        || (a == 192 && b == 0 && ip.octets()[2] == 0) // IETF protocol assignments
        || (a == 198 && (18..20).contains(&b)) // benchmarking, 198.18.0.0/15
        || a >= 240 // reserved
}

fn refused_v6(ip: Ipv6Addr) -> bool {
    let first = ip.segments()[0];
    // NAT64 (64:ff9b::/96) reaches the IPv4 address in its last 32 bits.
    let nat64 = ip.segments()[..6] == [0x64, 0xff9b, 0, 0, 0, 0];
    let [.., c, d] = ip.segments();
    let embedded = Ipv4Addr::new((c >> 8) as u8, c as u8, (d >> 8) as u8, d as u8);
    ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || (first & 0xfe00) == 0xfc00 // unique local, fc00::/7
        || (first & 0xffc0) == 0xfe80 // link-local, fe80::/10
        || (first == 0x2001 && ip.segments()[1] == 0x0db8) // documentation
        || (nat64 && refused_v4(embedded))
}

/// Why a callback URL is refused at admission (CB-2).
#[derive(Debug, thiserror::Error)]
pub(crate) enum BadUrl {
    /// Not a URL at all, or not absolute.
    #[error("not an absolute URL: {0}")]
    Unparsable(String),
    /// Another scheme than http or https.
    #[error("the scheme must be http or https, not {0:?}")]
    Scheme(String),
    /// Over [`MAX_URL_BYTES`].
    #[error("longer than {MAX_URL_BYTES} bytes")]
    TooLong,
    /// A literal address or `localhost` in a refused range.
    #[error(
        "{0} is a loopback, private, link-local or otherwise internal address; \
         name it in [callbacks] allow to permit it"
    )]
    Internal(String),
}

/// Checks `url` as far as it can be known without a DNS lookup (CB-2): absolute http(s),
/// at most [`MAX_URL_BYTES`], and no literal address (nor `localhost`) that `allow` does not
/// permit. Returns the parsed URL.
///
/// # Errors
/// [`BadUrl`] saying why.
pub(crate) fn check_url(url: &str, allow: &Allow) -> Result<reqwest::Url, BadUrl> {
    if url.len() > MAX_URL_BYTES {
        return Err(BadUrl::TooLong);
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| BadUrl::Unparsable(e.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(BadUrl::Scheme(parsed.scheme().to_string()));
    }
    let host = match parsed.host() {
        Some(url::Host::Ipv4(ip)) => Some(IpAddr::V4(ip)),
        Some(url::Host::Ipv6(ip)) => Some(IpAddr::V6(ip)),
        Some(url::Host::Domain(d)) => {
            let d = d.trim_end_matches('.').to_ascii_lowercase();
            (d == "localhost" || d.ends_with(".localhost"))
                .then_some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        }
        None => return Err(BadUrl::Unparsable("no host".into())),
    };
    match host {
        Some(ip) if !allow.permits(ip) => Err(BadUrl::Internal(
            parsed.host_str().unwrap_or_default().to_string(),
        )),
        _ => Ok(parsed),
    }
}

/// A resolution whose every address was refused (CB-5): the try is not made.
#[derive(Debug, thiserror::Error)]
#[error("{0} resolves only to refused (internal) addresses")]
pub(crate) struct Refused(pub(crate) String);

/// The resolver of the callback client: the system's lookup, then every address [`Allow`] does
/// not permit dropped; none left is [`Refused`].
#[derive(Debug, Clone)]
pub(crate) struct Guarded(pub(crate) Allow);

impl Resolve for Guarded {
    fn resolve(&self, name: Name) -> Resolving {
        let allow = self.0.clone();
        let host = name.as_str().to_string();
        Box::pin(async move {
            let found = tokio::net::lookup_host((host.as_str(), 0)).await?;
            let kept: Vec<SocketAddr> = found.filter(|a| allow.permits(a.ip())).collect();
            if kept.is_empty() {
                return Err(Box::new(Refused(host)) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(kept.into_iter()) as Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_ranges_are_refused_unless_allowed_cb2() {
        let none = Allow::default();
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fd00:ec2::254",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert!(!none.permits(ip), "{ip}");
        }
        for ip in ["93.184.216.34", "2606:2800:220:1::1", "8.8.8.8"] {
            assert!(none.permits(ip.parse().unwrap()), "{ip}");
        }
        let allow = Allow::new(&["127.0.0.1/32".into(), "10.0.0.0/8".into(), "::1".into()]);
        assert!(allow.permits("127.0.0.1".parse().unwrap()));
        assert!(allow.permits("::ffff:127.0.0.1".parse().unwrap()));
        assert!(allow.permits("10.9.9.9".parse().unwrap()));
        assert!(allow.permits("::1".parse().unwrap()));
        assert!(!allow.permits("127.0.0.2".parse().unwrap()));
        assert!(!allow.permits("169.254.169.254".parse().unwrap()));
    }

    #[test]
    fn admission_refuses_bad_schemes_literal_internal_hosts_and_localhost_cb2() {
        let none = Allow::default();
        assert!(check_url("https://example.com/hook?x=1", &none).is_ok());
        for bad in [
            "ftp://example.com/",
            "/relative",
            "http://169.254.169.254/latest/meta-data",
            "http://127.0.0.1:9/x",
            "http://[::1]/",
            "http://localhost:8080/",
            "http://api.localhost/",
        ] {
            assert!(check_url(bad, &none).is_err(), "{bad}");
        }
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_BYTES));
        assert!(matches!(check_url(&long, &none), Err(BadUrl::TooLong)));
        let loopback = Allow::new(&["127.0.0.0/8".into()]);
        assert!(check_url("http://127.0.0.1:9/x", &loopback).is_ok());
        assert!(check_url("http://localhost:9/x", &loopback).is_ok());
    }

    /// CB-5: a name that resolves only to refused addresses is refused at send time, inside
    /// the client's resolver; the allow-list admits it.
    #[tokio::test]
    async fn the_resolver_drops_refused_addresses_after_the_lookup_cb5() {
        let name = |s: &str| s.parse::<Name>().unwrap();
        let refused = Guarded(Allow::default()).resolve(name("localhost")).await;
        let err = refused.err().expect("localhost resolves only to loopback");
        assert!(err.downcast_ref::<Refused>().is_some(), "{err}");
        let allowed = Guarded(Allow::new(&["127.0.0.0/8".into(), "::1".into()]))
            .resolve(name("localhost"))
            .await
            .map_err(|e| e.to_string())
            .expect("allowed");
        let addrs: Vec<SocketAddr> = allowed.collect();
        assert!(
            !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback()),
            "{addrs:?}"
        );
    }
}
