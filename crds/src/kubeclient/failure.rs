//! Whether the API server refused a request or did not serve it: the one sorting of errors
//! that both binaries use to decide what a failure means.
//!
//! A refusal (403, 404, a body this process cannot read, a credential it cannot load) comes
//! from a server that is up and answering; it lasts until someone fixes the install, and a
//! restart of this process may cure it. A request the server did not serve (no connection, a
//! broken stream, 429, a 5xx, or 410 asking for a fresh list) is cured by the server's
//! recovery alone: waiting, never restarting, is the answer to it.

use kube::runtime::watcher;

/// What an error from the API server says about whether the server served the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiFailure {
    /// The API server answered and refused (403, 404, a body this process cannot read…).
    Refused,
    /// The server did not serve it (no connection, a broken stream, 429, a 5xx), or told a
    /// watch its version expired (410: it lists again at once). The server's recovery, not a
    /// restart, is the cure.
    NotServed,
}

impl ApiFailure {
    /// The `failure` label of the watch-error counters of both binaries.
    pub fn label(self) -> &'static str {
        match self {
            ApiFailure::Refused => "refused",
            ApiFailure::NotServed => "not_served",
        }
    }

    /// Whether a watch's error is the API server refusing it (a restart of this process may cure
    /// that) or the server not serving it, or asking for a fresh list (only its recovery, or the
    /// list the watch asks for at once, does).
    pub fn of_watch(e: &watcher::Error) -> ApiFailure {
        match e {
            watcher::Error::WatchError(status) => Self::of_status(status.code),
            watcher::Error::InitialListFailed(e)
            | watcher::Error::WatchStartFailed(e)
            | watcher::Error::WatchFailed(e) => Self::of_request(e),
            watcher::Error::NoResourceVersion => ApiFailure::Refused,
        }
    }

    /// The same sorting for any one request to the API server: whether it refused the request, or
    /// did not serve it (then only waiting for the server helps).
    pub fn of_request(e: &kube::Error) -> ApiFailure {
        match e {
            kube::Error::Api(status) => Self::of_status(status.code),
            // This process could not authenticate the request (a token file or credential plugin
            // that fails): a new process may well, so it counts as a refusal.
            kube::Error::Service(e) if e.is::<kube::client::AuthError>() => ApiFailure::Refused,
            // No connection, a timeout, a stream broken off: nothing served it.
            kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_) => {
                ApiFailure::NotServed
            }
            // Served, and unreadable here (a body this version cannot decode): as a refusal.
            _ => ApiFailure::Refused,
        }
    }

    fn of_status(code: u16) -> ApiFailure {
        match code {
            410 | 429 | 500..=599 => ApiFailure::NotServed,
            _ => ApiFailure::Refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_error_is_sorted_by_whether_the_server_served_it() {
        use kube::core::Status;
        let api =
            |code: u16| kube::Error::Api(Box::new(Status::failure("no", "x").with_code(code)));
        let in_stream = |code: u16| {
            watcher::Error::WatchError(Box::new(Status::failure("no", "x").with_code(code)))
        };
        let expected = [
            (ApiFailure::Refused, [400, 401, 403, 404, 422]),
            (ApiFailure::NotServed, [410, 429, 500, 503, 504]),
        ];
        for (want, codes) in expected {
            for code in codes {
                // Said in the watch stream, in answer to the watch request, or to the list.
                for e in [
                    in_stream(code),
                    watcher::Error::WatchStartFailed(api(code)),
                    watcher::Error::InitialListFailed(api(code)),
                ] {
                    assert_eq!(ApiFailure::of_watch(&e), want, "{code}: {e}");
                }
            }
        }
        let refused_connection = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(
            ApiFailure::of_watch(&watcher::Error::WatchStartFailed(kube::Error::Service(
                refused_connection.into()
            ))),
            ApiFailure::NotServed
        );
        let no_token = kube::client::AuthError::ReadTokenFile(
            std::io::Error::from(std::io::ErrorKind::NotFound),
            "/var/run/secrets/token".into(),
        );
        assert_eq!(
            ApiFailure::of_watch(&watcher::Error::WatchStartFailed(kube::Error::Service(
                no_token.into()
            ))),
            ApiFailure::Refused,
            "a credential this process cannot load"
        );
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(
            ApiFailure::of_watch(&watcher::Error::WatchFailed(kube::Error::ReadEvents(reset))),
            ApiFailure::NotServed
        );
        let unreadable = serde_json::from_str::<u32>("{").unwrap_err();
        assert_eq!(
            ApiFailure::of_watch(&watcher::Error::InitialListFailed(kube::Error::SerdeError(
                unreadable
            ))),
            ApiFailure::Refused
        );
    }
}
