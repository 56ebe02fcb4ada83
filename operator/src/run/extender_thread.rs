//! The extender's own thread.
//!
//! kube-scheduler waits on every `filter`, `prioritize` and `bind` call, so they are served by a
//! single-threaded runtime of their own. On the main runtime a call's connection could sit in
//! the run queue behind reconciles, sweeps and the decoding of watch events before its handler
//! even read the request: time that the operator's own latency histograms never see, but the
//! scheduler does. Here the only work queued ahead of a call is other extender calls. The
//! admission webhook shares the listener, so it is served here too.
//!
//! The thread serves until the [`ExtenderThread`] is dropped, which `run` keeps for as long as
//! it runs: an operator stopped mid-flight (its `run` future dropped) stops answering, as a
//! killed process would.

use axum::Router;
use axum::serve::ListenerExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_rustls::TlsAcceptor;

use crate::extender::tls::{Caller, TlsListener};
use crate::telemetry::ReasonLabels;

/// The running extender thread; dropping it stops the server (the thread sees its end of the
/// channel closed).
pub struct ExtenderThread {
    _stop: oneshot::Sender<()>,
}

/// Serves `app` on `listener` (TLS when `tls` is given) from a new thread. The receiver
/// resolves (with an error: nothing is sent) once the server has stopped and its listener is
/// closed, whether it failed or the returned [`ExtenderThread`] was dropped.
pub fn spawn(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    handshake_failures: Family<ReasonLabels, Counter>,
    app: Router,
) -> std::io::Result<(ExtenderThread, oneshot::Receiver<()>)> {
    // The listener was registered with the main runtime's reactor: hand it over as a plain
    // socket (still non-blocking) and register it again with the thread's.
    let listener = listener.into_std()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (stop, stop_requested) = oneshot::channel::<()>();
    let (done, stopped) = oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("extender".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "extender listener could not be registered");
                        return;
                    }
                };
                tokio::select! {
                    () = serve(listener, tls, handshake_failures, app) => {}
                    _ = stop_requested => {}
                }
            });
            // Connections still open are dropped with the runtime, without waiting.
            runtime.shutdown_background();
            drop(done);
        })?;
    Ok((ExtenderThread { _stop: stop }, stopped))
}

async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    handshake_failures: Family<ReasonLabels, Counter>,
    app: Router,
) {
    let result = match tls {
        // Each request learns whether its caller presented a client certificate
        // (`extender::tls::require_client` reads it).
        Some(acceptor) => {
            axum::serve(
                TlsListener::new(listener, acceptor, handshake_failures),
                app.into_make_service_with_connect_info::<Caller>(),
            )
            .await
        }
        None => {
            // Answers go out as soon as they are written: with Nagle, a response written in
            // parts can wait for the scheduler's delayed ACK.
            let listener = listener.tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "could not disable Nagle");
                }
            });
            axum::serve(listener, app).await
        }
    };
    if let Err(e) = result {
        tracing::error!(error = %e, "extender server failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get_root(port: u16) -> std::io::Result<String> {
        let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await?;
        let mut answer = String::new();
        c.read_to_string(&mut answer).await?;
        Ok(answer)
    }

    #[tokio::test]
    async fn serves_on_its_own_thread_until_dropped() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let app = Router::new().route(
            "/",
            get(|| async { std::thread::current().name().unwrap_or("").to_string() }),
        );
        let (thread, stopped) = spawn(listener, None, Family::default(), app).unwrap();
        let answer = get_root(port).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(
            answer.ends_with("extender"),
            "handled off the caller's thread: {answer}"
        );

        drop(thread);
        // Waits for the thread itself: the server is gone, and so is its listener.
        let ended = tokio::time::timeout(std::time::Duration::from_secs(10), stopped)
            .await
            .expect("the thread stops once its guard is dropped");
        assert!(ended.is_err(), "ends by dropping, not sending");
        assert!(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err(),
            "the port is closed once the thread has stopped"
        );
    }
}
