//! AMQP 0.9.1 (RabbitMQ) target: publish with publisher confirms, `delivery_mode` 2
//! (persistent) and `mandatory`, so a nack or an unroutable return is a requeue failure. How a
//! job's headers map to an AMQP message is the broker's codec ([`crate::broker::amqp`]), which
//! the source uses too.
//!
//! # Where a job goes
//!
//! A record with an `origin` (collected from a dead-letter queue) goes back to its x-death
//! exchange and routing key unless the target's `route` is `target`; a record without one goes
//! to the target's `exchange` + `routingKey`.

use futures::future::BoxFuture;
use lapin::options::ExchangeDeclareOptions;
use lapin::types::{FieldTable, ShortString};

use super::{JobMessage, Target, TargetError};
use crate::broker::BrokerError;
use crate::broker::amqp::{AmqpConn, classify, properties_for, short};
use dlq_core::api::{self, Route};

/// Exchange and routing key for `job` under `route`.
pub fn address<'a>(
    route: Route,
    job: &'a JobMessage,
    exchange: &'a str,
    routing_key: &'a str,
) -> (&'a str, &'a str) {
    if route == Route::Origin
        && let Some(origin) = &job.origin
        && let (Some(ex), Some(rk)) = (&origin.exchange, &origin.routing_key)
    {
        return (ex, rk);
    }
    (exchange, routing_key)
}

pub struct AmqpTarget {
    conn: AmqpConn,
    exchange: String,
    routing_key: String,
    route: Route,
}

impl AmqpTarget {
    pub fn new(spec: &api::AmqpTargetSpec, url: &str) -> Result<Self, TargetError> {
        Ok(AmqpTarget {
            conn: AmqpConn::new(url)?,
            exchange: spec.exchange.clone(),
            routing_key: spec.routing_key.clone(),
            route: spec.route.unwrap_or_default(),
        })
    }
}

impl Target for AmqpTarget {
    fn describe(&self) -> String {
        let ex = if self.exchange.is_empty() {
            "(default)"
        } else {
            &self.exchange
        };
        let origin = match self.route {
            Route::Origin => " (or the record's origin)",
            Route::Target => "",
        };
        format!("amqp exchange {ex} key {}{origin}", self.routing_key)
    }

    fn requeue<'a>(&'a self, job: &'a JobMessage) -> BoxFuture<'a, Result<(), TargetError>> {
        Box::pin(async move {
            let props = properties_for(&job.headers_with_key())?;
            let (exchange, routing_key) =
                address(self.route, job, &self.exchange, &self.routing_key);
            self.conn
                .publish(exchange, routing_key, &job.payload, props)
                .await?;
            Ok(())
        })
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), TargetError>> {
        Box::pin(async move {
            let (conn, _) = self.conn.get().await?;
            if self.exchange.is_empty() {
                return Ok(());
            }
            // A passive declare on a throwaway channel: a missing exchange closes only that one.
            let ch = conn.create_channel().await.map_err(|e| classify(&e))?;
            let found = ch
                .exchange_declare(
                    short("exchange", &self.exchange)?,
                    lapin::ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await;
            let _ = ch.close(200, ShortString::from("probe")).await;
            found.map_err(|e| match classify(&e) {
                BrokerError::Refused(m) => {
                    TargetError::Refused(format!("exchange {:?}: {m}", self.exchange))
                }
                other => other.into(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use dlq_core::api::Origin;

    #[test]
    fn origin_wins_unless_the_route_says_target() {
        let mut job = JobMessage {
            id: "j".into(),
            payload: vec![].into(),
            null_payload: false,
            headers: BTreeMap::new(),
            origin: None,
            idempotency_key: None,
            key_header: None,
        };
        assert_eq!(address(Route::Origin, &job, "ex", "rk"), ("ex", "rk"));
        job.origin = Some(Origin {
            exchange: Some("".into()),
            routing_key: Some("orders".into()),
            queue: Some("orders".into()),
            ..Origin::default()
        });
        assert_eq!(address(Route::Origin, &job, "ex", "rk"), ("", "orders"));
        assert_eq!(address(Route::Target, &job, "ex", "rk"), ("ex", "rk"));
    }
}
