//! AMQP 0.9.1 (RabbitMQ), for its source and its target: one connection with a confirm-mode
//! channel (publish with publisher confirms, `delivery_mode` 2 (persistent) and `mandatory`, so
//! a nack or an unroutable return is an error), the header codec, and the refusal classifier.
//!
//! # How a job's headers map to an AMQP message
//!
//! A record holds string headers; an AMQP message has typed properties and a typed header
//! table. The mapping is exact in both directions (the source bridge uses the same functions):
//!
//! - Properties become headers under their AMQP names: `content-type`, `content-encoding`,
//!   `message-id`, `correlation-id`, `reply-to`, `expiration`, `type`, `user-id`, `app-id`,
//!   `cluster-id`, `priority` (0-255) and `timestamp` (seconds since the epoch).
//!   `delivery-mode` is not kept: a redrive is always persistent.
//! - Table headers whose value is a UTF-8 string (without CR/LF/NUL, at most 8 KiB) and whose
//!   name is an HTTP token that is not a property name keep their name and value.
//! - Every other table entry (numbers, booleans, nested tables, arrays, bytes, odd names) goes
//!   into one header, `amqp-table`: a JSON object of name to value, where a string is
//!   `{"S": "text"}` and anything else is the AMQP type-tagged value (`{"LongInt": 3}`), so
//!   the redriven message carries the same types.
//! - RabbitMQ's dead-letter bookkeeping (`x-death`, `x-first-death-*`, `x-last-death-*`) and a
//!   quorum queue's `x-delivery-count` are not job headers: the source bridge turns them into
//!   `deliveries`, `reason` and `origin` and does not carry them back (a carried
//!   `x-delivery-count` would count old deliveries against the delivery limit again).
//!
//! `user-id` is checked by RabbitMQ against the publishing user: a job carrying another user's
//! id is refused by the broker (condition + Event), never rewritten.
//!

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::protocol::AMQPErrorKind;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::Mutex;

use super::BrokerError;
use super::backend::ConnectError;
use crate::secret::SecretReads;
use dlq_core::api;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// The header holding table entries that are not plain strings (see the module doc).
pub const TABLE_HEADER: &str = "amqp-table";

/// Table headers RabbitMQ adds when it dead-letters or redelivers a message.
pub const BROKER_HEADERS: &[&str] = &[
    "x-death",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-first-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    "x-last-death-exchange",
    "x-delivery-count",
];

/// String properties, by header name.
const STRING_PROPERTIES: &[&str] = &[
    "content-type",
    "content-encoding",
    "message-id",
    "correlation-id",
    "reply-to",
    "expiration",
    "type",
    "user-id",
    "app-id",
    "cluster-id",
];

fn is_property(name: &str) -> bool {
    STRING_PROPERTIES.contains(&name) || name == "priority" || name == "timestamp"
}

fn string_property<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a ShortString> {
    match name {
        "content-type" => props.content_type().as_ref(),
        "content-encoding" => props.content_encoding().as_ref(),
        "message-id" => props.message_id().as_ref(),
        "correlation-id" => props.correlation_id().as_ref(),
        "reply-to" => props.reply_to().as_ref(),
        "expiration" => props.expiration().as_ref(),
        "type" => props.kind().as_ref(),
        "user-id" => props.user_id().as_ref(),
        "app-id" => props.app_id().as_ref(),
        "cluster-id" => props.cluster_id().as_ref(),
        _ => None,
    }
}

fn with_string_property(props: BasicProperties, name: &str, v: ShortString) -> BasicProperties {
    match name {
        "content-type" => props.with_content_type(v),
        "content-encoding" => props.with_content_encoding(v),
        "message-id" => props.with_message_id(v),
        "correlation-id" => props.with_correlation_id(v),
        "reply-to" => props.with_reply_to(v),
        "expiration" => props.with_expiration(v),
        "type" => props.with_type(v),
        "user-id" => props.with_user_id(v),
        "app-id" => props.with_app_id(v),
        "cluster-id" => props.with_cluster_id(v),
        _ => props,
    }
}

/// A message's properties and headers as job headers, without the broker's bookkeeping.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Carried {
    pub headers: BTreeMap<String, String>,
    /// Names that a record cannot hold (over the header count or size limits).
    pub lost: Vec<String>,
}

fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
        && !is_property(name)
        && name != TABLE_HEADER
}

fn plain_value(v: &str) -> bool {
    v.len() <= api::MAX_HEADER_VALUE_LEN && !v.contains(['\r', '\n', '\0'])
}

fn encode_value(v: &AMQPValue) -> serde_json::Value {
    if let AMQPValue::LongString(s) = v
        && let Ok(text) = std::str::from_utf8(s.as_bytes())
    {
        return serde_json::json!({ "S": text });
    }
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

fn decode_value(v: &serde_json::Value) -> Result<AMQPValue, String> {
    if let Some(obj) = v.as_object()
        && obj.len() == 1
        && let Some(serde_json::Value::String(text)) = obj.get("S")
    {
        return Ok(AMQPValue::LongString(LongString::from(text.as_bytes())));
    }
    serde_json::from_value(v.clone()).map_err(|e| e.to_string())
}

/// The job headers of a message (see the module doc for the mapping).
pub fn carried_headers(props: &BasicProperties) -> Carried {
    let mut headers = BTreeMap::new();
    for name in STRING_PROPERTIES {
        if let Some(v) = string_property(props, name) {
            headers.insert(name.to_string(), v.as_str().to_string());
        }
    }
    if let Some(p) = props.priority() {
        headers.insert("priority".into(), p.to_string());
    }
    if let Some(t) = props.timestamp() {
        headers.insert("timestamp".into(), t.to_string());
    }
    let mut typed = serde_json::Map::new();
    if let Some(table) = props.headers() {
        for (k, v) in table {
            let name = k.as_str();
            if BROKER_HEADERS.contains(&name) {
                continue;
            }
            let text = match v {
                AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
                _ => None,
            };
            match text {
                Some(text) if plain_name(name) && plain_value(text) => {
                    headers.insert(name.to_string(), text.to_string());
                }
                _ => {
                    typed.insert(name.to_string(), encode_value(v));
                }
            }
        }
    }
    let mut lost = Vec::new();
    if !typed.is_empty() {
        let json = serde_json::Value::Object(typed.clone()).to_string();
        if plain_value(&json) {
            headers.insert(TABLE_HEADER.into(), json);
        } else {
            lost.extend(typed.keys().cloned());
        }
    }
    while headers.len() > api::MAX_HEADERS {
        // Keep properties; give up the last user headers, and say so.
        let Some(name) = headers.keys().rev().find(|k| !is_property(k)).cloned() else {
            break;
        };
        headers.remove(&name);
        lost.push(name);
    }
    lost.sort();
    Carried { headers, lost }
}

pub fn short(what: &str, v: &str) -> Result<ShortString, BrokerError> {
    ShortString::try_new(v)
        .map_err(|_| BrokerError::Invalid(format!("{what} is longer than AMQP's 255 bytes")))
}

/// The properties (with header table) that carry `headers` untouched; persistent.
pub fn properties_for(headers: &BTreeMap<String, String>) -> Result<BasicProperties, BrokerError> {
    let mut props = BasicProperties::default().with_delivery_mode(2);
    let mut table = FieldTable::default();
    for (name, value) in headers {
        if STRING_PROPERTIES.contains(&name.as_str()) {
            props = with_string_property(props, name, short(name, value)?);
        } else if name == "priority" {
            let p = value.parse::<u8>().map_err(|_| {
                BrokerError::Invalid(format!("header priority {value:?} is not 0-255"))
            })?;
            props = props.with_priority(p);
        } else if name == "timestamp" {
            let t = value.parse::<u64>().map_err(|_| {
                BrokerError::Invalid(format!(
                    "header timestamp {value:?} is not seconds since the epoch"
                ))
            })?;
            props = props.with_timestamp(t);
        } else if name == TABLE_HEADER {
            let typed: serde_json::Map<String, serde_json::Value> = serde_json::from_str(value)
                .map_err(|e| BrokerError::Invalid(format!("header {TABLE_HEADER}: {e}")))?;
            for (k, v) in &typed {
                let v = decode_value(v).map_err(|e| {
                    BrokerError::Invalid(format!("header {TABLE_HEADER} entry {k}: {e}"))
                })?;
                table.insert(short("header name", k)?, v);
            }
        } else {
            table.insert(
                short("header name", name)?,
                AMQPValue::LongString(LongString::from(value.as_bytes())),
            );
        }
    }
    if !table.inner().is_empty() {
        props = props.with_headers(table);
    }
    Ok(props)
}

/// Sorts a lapin error into unreachable (connection trouble) or refused (the broker said no).
pub fn classify(e: &lapin::Error) -> BrokerError {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(_) => BrokerError::Refused(amqp.get_message().as_str().to_string()),
            AMQPErrorKind::Hard(_) => {
                BrokerError::Unreachable(amqp.get_message().as_str().to_string())
            }
        },
        _ => BrokerError::Unreachable(e.to_string()),
    }
}

/// One connection with a confirm-mode channel, reopened after an error.
pub struct AmqpConn {
    url: String,
    state: Mutex<Option<(Arc<Connection>, Channel)>>,
}

impl AmqpConn {
    pub fn new(url: &str) -> Result<Self, BrokerError> {
        url.parse::<lapin::uri::AMQPUri>().map_err(|_| {
            BrokerError::Config(
                "the AMQP URL in the secret is not a valid amqp:// or amqps:// URL".into(),
            )
        })?;
        Ok(AmqpConn {
            url: url.to_string(),
            state: Mutex::new(None),
        })
    }

    /// Opens a connection (never logs the URL, which holds the password).
    pub async fn connect(url: &str) -> Result<Connection, BrokerError> {
        let props = ConnectionProperties::default()
            .with_connection_name(LongString::from("deadletter-operator".as_bytes()));
        match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(url, props)).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(match classify(&e) {
                BrokerError::Refused(m) => BrokerError::Unreachable(m),
                other => other,
            }),
            Err(_) => Err(BrokerError::Unreachable(format!(
                "no AMQP connection within {}s",
                CONNECT_TIMEOUT.as_secs()
            ))),
        }
    }

    /// The live connection and confirm channel, reconnecting as needed.
    pub async fn get(&self) -> Result<(Arc<Connection>, Channel), BrokerError> {
        let mut slot = self.state.lock().await;
        if let Some((conn, ch)) = slot.as_ref() {
            if conn.status().connected() && ch.status().connected() {
                return Ok((conn.clone(), ch.clone()));
            }
            if conn.status().connected() {
                // The broker closed only the channel (e.g. a missing exchange): open another.
                let ch = open_confirm_channel(conn).await?;
                let conn = conn.clone();
                *slot = Some((conn.clone(), ch.clone()));
                return Ok((conn, ch));
            }
        }
        let conn = Arc::new(Self::connect(&self.url).await?);
        let ch = open_confirm_channel(&conn).await?;
        *slot = Some((conn.clone(), ch.clone()));
        Ok((conn, ch))
    }

    /// Forgets the connection after a timeout so the next call starts afresh.
    pub async fn reset(&self) {
        if let Some((conn, _)) = self.state.lock().await.take() {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                conn.close(200, ShortString::from("reset")),
            )
            .await;
        }
    }

    /// Publishes and waits for the broker's confirm; returns and nacks are errors.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        props: BasicProperties,
    ) -> Result<(), BrokerError> {
        let ex = short("exchange", exchange)?;
        let rk = short("routing key", routing_key)?;
        let (_, ch) = self.get().await?;
        let opts = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let confirmed = tokio::time::timeout(CONFIRM_TIMEOUT, async {
            ch.basic_publish(ex, rk, opts, payload, props).await?.await
        })
        .await;
        match confirmed {
            Err(_) => {
                self.reset().await;
                Err(BrokerError::Unreachable(format!(
                    "no publisher confirm within {}s",
                    CONFIRM_TIMEOUT.as_secs()
                )))
            }
            Ok(Err(e)) => Err(classify(&e)),
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret)))) => {
                Err(BrokerError::Refused(format!(
                    "unroutable: the broker returned it ({} {}): nothing is bound to exchange {:?} with routing key {:?}",
                    ret.reply_code,
                    ret.reply_text.as_str(),
                    exchange,
                    routing_key
                )))
            }
            Ok(Ok(Confirmation::Nack(None))) => Err(BrokerError::Refused(
                "the broker nacked the message (it could not store it)".into(),
            )),
            Ok(Ok(Confirmation::NotRequested)) => Err(BrokerError::Refused(
                "the channel is not in confirm mode; nothing confirmed the message".into(),
            )),
        }
    }
}

async fn open_confirm_channel(conn: &Connection) -> Result<Channel, BrokerError> {
    let ch = conn.create_channel().await.map_err(|e| classify(&e))?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| classify(&e))?;
    Ok(ch)
}

/// Declares (passively) that `queue` exists, on a throwaway channel.
pub async fn queue_exists(conn: &Connection, queue: &str) -> Result<(), BrokerError> {
    let ch = conn.create_channel().await.map_err(|e| classify(&e))?;
    let r = ch
        .queue_declare(
            short("queue", queue)?,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    let _ = ch.close(200, ShortString::from("checked")).await;
    r.map(|_| ()).map_err(|e| classify(&e))
}

/// How many messages `queue` holds ready for a consumer (a passive declare on a throwaway
/// channel). Messages delivered and not yet acknowledged are not among them.
pub async fn queue_depth(conn: &Connection, queue: &str) -> Result<i64, BrokerError> {
    let ch = conn.create_channel().await.map_err(|e| classify(&e))?;
    let r = ch
        .queue_declare(
            short("queue", queue)?,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    let _ = ch.close(200, ShortString::from("counted")).await;
    r.map(|q| i64::from(q.message_count()))
        .map_err(|e| classify(&e))
}

/// A RabbitMQ target's URL, always from its own Secret.
pub async fn target_url(
    secrets: &mut SecretReads<'_>,
    target: &api::AmqpTargetSpec,
) -> Result<String, ConnectError> {
    Ok(secrets.value(&target.url_secret_ref).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert(ShortString::from(k), v);
        }
        t
    }

    fn s(v: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(v.as_bytes()))
    }

    #[test]
    fn properties_and_headers_round_trip_exactly() {
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_message_id("m-1".into())
            .with_correlation_id("c-1".into())
            .with_priority(7)
            .with_timestamp(1_700_000_000)
            .with_delivery_mode(1)
            .with_headers(table(vec![
                ("x-trace", s("abc")),
                ("x-retries", AMQPValue::LongInt(3)),
                ("x-flag", AMQPValue::Boolean(true)),
                ("content-type", s("clash with the property")),
                ("x-multi", s("line1\nline2")),
                (
                    "x-nested",
                    AMQPValue::FieldTable(table(vec![("a", AMQPValue::LongLongInt(-5))])),
                ),
                ("x-death", AMQPValue::FieldArray(vec![].into())),
                ("x-delivery-count", AMQPValue::LongLongInt(4)),
            ]));
        let carried = carried_headers(&props);
        assert!(carried.lost.is_empty());
        let h = &carried.headers;
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h["message-id"], "m-1");
        assert_eq!(h["priority"], "7");
        assert_eq!(h["timestamp"], "1700000000");
        assert_eq!(h["x-trace"], "abc");
        assert!(!h.contains_key("x-death") && !h.contains_key("x-delivery-count"));
        assert!(!h.contains_key("delivery-mode"));
        let typed: serde_json::Value = serde_json::from_str(&h[TABLE_HEADER]).unwrap();
        assert_eq!(typed["x-retries"], serde_json::json!({"LongInt": 3}));
        assert_eq!(
            typed["content-type"],
            serde_json::json!({"S": "clash with the property"})
        );

        let back = properties_for(h).unwrap();
        assert_eq!(back.delivery_mode(), &Some(2), "redrive is persistent");
        assert_eq!(back.content_type(), props.content_type());
        assert_eq!(back.message_id(), props.message_id());
        assert_eq!(back.correlation_id(), props.correlation_id());
        assert_eq!(back.priority(), props.priority());
        assert_eq!(back.timestamp(), props.timestamp());
        let mut want = props.headers().clone().unwrap();
        let mut inner = want.inner().clone();
        inner.remove("x-death");
        inner.remove("x-delivery-count");
        want = inner.into();
        assert_eq!(
            back.headers().as_ref(),
            Some(&want),
            "same table, same types"
        );
    }

    #[test]
    fn plain_job_headers_become_string_headers() {
        let h = BTreeMap::from([
            ("x-trace".to_string(), "t".to_string()),
            ("message-id".to_string(), "id-9".to_string()),
        ]);
        let p = properties_for(&h).unwrap();
        assert_eq!(p.message_id().as_ref().map(|m| m.as_str()), Some("id-9"));
        assert_eq!(p.headers().as_ref().unwrap().inner()["x-trace"], s("t"));
        let bad = BTreeMap::from([("priority".to_string(), "high".to_string())]);
        assert!(matches!(properties_for(&bad), Err(BrokerError::Invalid(_))));
    }

    #[test]
    fn oversized_tables_are_reported_not_silently_cut() {
        let big = "x".repeat(9000);
        let props = BasicProperties::default().with_headers(table(vec![("x-big", s(&big))]));
        let carried = carried_headers(&props);
        assert_eq!(carried.lost, vec!["x-big".to_string()]);
        assert!(!carried.headers.contains_key("x-big"));
    }
}
