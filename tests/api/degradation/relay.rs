//! A TCP relay in front of PostgreSQL that can go silent: while paused it reads nothing from
//! either side and forwards nothing, and new connections are accepted and left hanging — what a
//! node sees when the database's network drops packets (its own TCP acknowledges what it
//! sent, no answer comes). Resumed, everything held flows on, as TCP retransmission would
//! deliver it once the network heals.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct SilentRelay {
    pub port: u16,
    paused: watch::Sender<bool>,
}

impl SilentRelay {
    /// A relay to `server` (`host:port`) on a free loopback port, forwarding.
    pub async fn start(server: String) -> SilentRelay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let port = listener.local_addr().expect("relay address").port();
        let (paused, watching) = watch::channel(false);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (server, paused) = (server.clone(), watching.clone());
                tokio::spawn(async move {
                    wait_resumed(&mut paused.clone()).await;
                    if let Ok(upstream) = TcpStream::connect(&server).await {
                        relay(client, upstream, paused).await;
                    }
                });
            }
        });
        SilentRelay { port, paused }
    }

    /// `url` (a PostgreSQL URL) pointed at a new relay in front of its server.
    pub async fn in_front_of(url: &str) -> (SilentRelay, String) {
        let mut url = reqwest::Url::parse(url).expect("database url");
        let server = format!(
            "{}:{}",
            url.host_str().expect("database host"),
            url.port().unwrap_or(5432)
        );
        let relay = SilentRelay::start(server).await;
        url.set_port(Some(relay.port)).expect("relay port");
        (relay, url.to_string())
    }

    /// Stops every byte, both ways, until [`SilentRelay::resume`].
    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    pub fn resume(&self) {
        self.paused.send_replace(false);
    }
}

async fn wait_resumed(paused: &mut watch::Receiver<bool>) {
    let _ = paused.wait_for(|p| !*p).await;
}

/// Copies `from` to `to`, holding each piece while the relay is paused.
async fn copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut paused: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        wait_resumed(&mut paused).await;
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        wait_resumed(&mut paused).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

async fn relay(client: TcpStream, server: TcpStream, paused: watch::Receiver<bool>) {
    let (from_client, to_client) = client.into_split();
    let (from_server, to_server) = server.into_split();
    tokio::select! {
        () = copy(from_client, to_server, paused.clone()) => {}
        () = copy(from_server, to_client, paused) => {}
    }
}
