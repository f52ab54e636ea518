//! Who may talk to the page: the holder of the run's token, from this machine, via a page the
//! server itself rendered (CSRF). Also the headers that keep the browser strict.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, COOKIE, HOST, LOCATION, ORIGIN,
    REFERRER_POLICY, SET_COOKIE, X_CONTENT_TYPE_OPTIONS, X_FRAME_OPTIONS,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::state::Ui;
use crate::session::CliError;

/// No inline script or style, nothing from elsewhere, no framing, forms only to this server.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// 32 random bytes as hex, from the OS.
pub fn secret() -> Result<String, CliError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)
        .map_err(|e| CliError::Io("random token".into(), std::io::Error::other(e.to_string())))?;
    Ok(hex::encode(bytes))
}

/// Compares secrets without stopping at the first differing byte.
pub fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// The cookie name carries the port: two runs on one machine do not overwrite each other.
fn cookie_name(ui: &Ui) -> String {
    format!("dlq_ui_{}", ui.authority.rsplit(':').next().unwrap_or("0"))
}

fn cookie_token<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// `?token=` in the URL, if any.
fn query_token(req: &Request) -> Option<String> {
    form_urlencoded::parse(req.uri().query()?.as_bytes())
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.into_owned())
}

/// Every request: right Host, then the token (URL once, cookie after), then same-origin writes.
pub async fn guard(State(ui): State<Arc<Ui>>, req: Request, next: Next) -> Response {
    let host_ok = req
        .headers()
        .get(HOST)
        .and_then(|h| h.to_str().ok())
        .is_some_and(|h| h == ui.authority || h == ui.authority.replace("127.0.0.1", "localhost"));
    if !host_ok {
        return strict(refuse(StatusCode::FORBIDDEN, "unexpected Host header"));
    }
    let name = cookie_name(&ui);
    if let Some(t) = query_token(&req) {
        if !same_secret(&t, &ui.token) {
            return strict(refuse(StatusCode::UNAUTHORIZED, "wrong token"));
        }
        // Trade the URL token for a cookie and drop it from the address bar and history.
        let cookie = format!("{name}={}; Path=/; HttpOnly; SameSite=Strict", ui.token);
        let mut r = StatusCode::SEE_OTHER.into_response();
        let headers = r.headers_mut();
        headers.insert(LOCATION, HeaderValue::from_static("/"));
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            headers.insert(SET_COOKIE, v);
        }
        return strict(r);
    }
    if !cookie_token(req.headers(), &name).is_some_and(|t| same_secret(t, &ui.token)) {
        return strict(refuse(
            StatusCode::UNAUTHORIZED,
            "open the URL that `kubectl dlq ui` printed (it holds this run's token)",
        ));
    }
    if req.method() != Method::GET && !same_origin(req.headers(), &ui.authority) {
        return strict(refuse(
            StatusCode::FORBIDDEN,
            "cross-origin request refused",
        ));
    }
    strict(next.run(req).await)
}

/// A write must come from this page: Origin, when the browser sends one, is ours.
fn same_origin(headers: &HeaderMap, authority: &str) -> bool {
    match headers.get(ORIGIN).and_then(|o| o.to_str().ok()) {
        None => true,
        Some(o) => o == format!("http://{authority}"),
    }
}

/// The form's CSRF field is this run's: a page another site rendered cannot know it.
pub fn csrf_ok(ui: &Ui, form: &[(String, String)]) -> bool {
    form.iter()
        .any(|(k, v)| k == "csrf" && same_secret(v, &ui.csrf))
}

pub fn refuse(code: StatusCode, why: &'static str) -> Response {
    (code, why).into_response()
}

/// The browser-side rules on every response.
fn strict(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // Not no-referrer: with it, Chrome sends `Origin: null` on form posts and same_origin fails.
    h.insert(REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// A compiled-in asset.
pub fn asset(body: &'static str, content_type: &'static str) -> Response {
    ([(CONTENT_TYPE, content_type)], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_by_content() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert!(!same_secret("abc", "ab"));
        let (a, b) = (secret().unwrap(), secret().unwrap());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }

    #[test]
    fn origin_must_be_ours_when_sent() {
        let mut h = HeaderMap::new();
        assert!(same_origin(&h, "127.0.0.1:1"));
        h.insert(ORIGIN, HeaderValue::from_static("http://127.0.0.1:1"));
        assert!(same_origin(&h, "127.0.0.1:1"));
        h.insert(ORIGIN, HeaderValue::from_static("http://evil.example"));
        assert!(!same_origin(&h, "127.0.0.1:1"));
    }
}
