//! The frame of every page and of every refusal: the pages, the decisions and the replays
//! answer in it. Its own module so that those may name each other's parts without a cycle.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};

use super::state::Ui;

/// The frame of every page: who you are, where you look.
pub fn layout(ui: &Ui, title: &str, body: Markup) -> Response {
    let scope = ui
        .namespace
        .as_deref()
        .map_or("all namespaces".to_string(), |n| format!("namespace {n}"));
    Html(
        html! {
            (DOCTYPE)
            html lang="en" {
                head {
                    meta charset="utf-8";
                    // htmx would otherwise inject an inline <style>, which the CSP forbids.
                    meta name="htmx-config" content=r#"{"includeIndicatorStyles":false}"#;
                    // Same-origin scripts may read it; another site's page cannot.
                    meta name="csrf-token" content=(ui.csrf);
                    title { (title) " · kubectl dlq" }
                    link rel="stylesheet" href="/static/app.css";
                    script src="/static/htmx-2.0.4.min.js" {}
                }
                body {
                    header {
                        a.brand href="/" { "kubectl dlq" }
                        nav { a href="/" { "Groups & queues" } a href="/records" { "Records" } }
                        span #who { "acting as " b #user { (ui.user) } " · " (scope) }
                    }
                    main { (body) }
                }
            }
        }
        .into_string(),
    )
    .into_response()
}

/// An error in the page's words (the apiserver's message included).
pub fn failure(ui: &Ui, code: StatusCode, msg: &str) -> Response {
    let mut r = layout(ui, "Error", html! { p.error { (msg) } });
    *r.status_mut() = code;
    r
}
