//! Amazon SQS, for its source (a dead-letter queue) and its target: how to reach it (region,
//! endpoint, keys read from a Secret) and a client whose every call gives up in time.

use std::time::Duration;

use dlq_core::api::{AwsCredentialsRef, SecretKeyRef, SqsSourceSpec, SqsTargetSpec};

use super::backend::{ConnectError, Sides};
use crate::secret::{SecretError, SecretReads};

/// Static keys read from a Secret. No `Debug`: it must not reach a log line.
#[derive(Clone, Hash, PartialEq, Eq)]
pub struct AwsKeys {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

/// How to reach SQS: region, endpoint override, and keys (else the default AWS chain).
#[derive(Clone)]
pub struct SqsConn {
    pub region: Option<String>,
    pub endpoint: Option<String>,
    pub keys: Option<AwsKeys>,
}

impl SqsConn {
    /// The region of `queue_url` when it is an AWS one (`sqs.<region>.amazonaws.com`).
    pub fn region_of(queue_url: &str) -> Option<String> {
        let host = queue_url.split_once("://")?.1.split('/').next()?;
        let mut parts = host.split('.');
        match (parts.next(), parts.next(), parts.next()) {
            (Some("sqs"), Some(region), Some("amazonaws")) => Some(region.to_string()),
            (Some(region), Some("queue"), Some("amazonaws")) => Some(region.to_string()),
            _ => None,
        }
    }

    /// A client whose every call gives up after `timeout` (a long poll needs more than 20 s).
    pub async fn client(&self, timeout: Duration) -> aws_sdk_sqs::Client {
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let timeouts = aws_config::timeout::TimeoutConfig::builder()
            .connect_timeout(Duration::from_secs(5))
            .operation_attempt_timeout(timeout)
            .operation_timeout(timeout + Duration::from_secs(5))
            .build();
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .http_client(http)
            .timeout_config(timeouts)
            .retry_config(aws_config::retry::RetryConfig::standard().with_max_attempts(2));
        if let Some(region) = &self.region {
            loader = loader.region(aws_config::Region::new(region.clone()));
        }
        if let Some(k) = &self.keys {
            loader = loader.credentials_provider(aws_credential_types::Credentials::new(
                k.access_key_id.clone(),
                k.secret_access_key.clone(),
                k.session_token.clone(),
                None,
                "deadletter-operator-secret",
            ));
        }
        let shared = loader.load().await;
        let mut conf = aws_sdk_sqs::config::Builder::from(&shared);
        if let Some(endpoint) = &self.endpoint {
            conf = conf.endpoint_url(endpoint.trim_end_matches('/'));
        }
        aws_sdk_sqs::Client::from_conf(conf.build())
    }
}

/// The Secret's name for [`AwsCredentialsRef`](dlq_core::api::AwsCredentialsRef) keys.
pub const AWS_ACCESS_KEY_ID: &str = "AWS_ACCESS_KEY_ID";
pub const AWS_SECRET_ACCESS_KEY: &str = "AWS_SECRET_ACCESS_KEY";
pub const AWS_SESSION_TOKEN: &str = "AWS_SESSION_TOKEN";

/// Reads SQS keys from a Secret (the session token is optional).
pub async fn read_aws_keys(
    secrets: &mut SecretReads<'_>,
    r: &AwsCredentialsRef,
) -> Result<AwsKeys, SecretError> {
    let key = |k: &str| SecretKeyRef {
        name: r.name.clone(),
        key: k.to_string(),
    };
    let access_key_id = secrets.value(&key(AWS_ACCESS_KEY_ID)).await?;
    let secret_access_key = secrets.value(&key(AWS_SECRET_ACCESS_KEY)).await?;
    let session_token = match secrets.value(&key(AWS_SESSION_TOKEN)).await {
        Ok(token) => Some(token),
        Err(SecretError::NoKey { .. }) => None,
        Err(e) => return Err(e),
    };
    Ok(AwsKeys {
        access_key_id,
        secret_access_key,
        session_token,
    })
}

/// An SQS target's static keys, when its spec names a Secret (else the default AWS chain).
pub async fn target_keys(
    secrets: &mut SecretReads<'_>,
    target: &SqsTargetSpec,
) -> Result<Option<AwsKeys>, ConnectError> {
    match &target.credentials_secret_ref {
        Some(r) => Ok(Some(read_aws_keys(secrets, r).await?)),
        None => Ok(None),
    }
}

impl SqsConn {
    /// A source's region, endpoint and keys: its own, else its queue's SQS target's.
    pub async fn for_source(
        secrets: &mut SecretReads<'_>,
        sides: Sides<'_, SqsSourceSpec>,
    ) -> Result<SqsConn, ConnectError> {
        let source = sides.own;
        let creds = sides.either(
            |s| s.credentials_secret_ref.as_ref(),
            |t| t.credentials_secret_ref.as_ref(),
        );
        let region_of_url = SqsConn::region_of(&source.queue_url);
        let region = (source.region.as_ref().or(region_of_url.as_ref()))
            .or_else(|| sides.other.and_then(|t| t.region.as_ref()));
        Ok(SqsConn {
            region: region.cloned(),
            endpoint: sides
                .either(|s| s.endpoint.as_ref(), |t| t.endpoint.as_ref())
                .cloned(),
            keys: match creds {
                Some(r) => Some(read_aws_keys(secrets, r).await?),
                None => None,
            },
        })
    }
}

/// How many messages the queue at `url` holds: `ApproximateNumberOfMessages` (visible) plus
/// `ApproximateNumberOfMessagesNotVisible` (received, not yet deleted). SQS's own estimates.
pub async fn queue_depth(
    client: &aws_sdk_sqs::Client,
    url: &str,
) -> Result<i64, super::BrokerError> {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let answer = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(A::ApproximateNumberOfMessages)
        .attribute_names(A::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .map_err(|e| {
            super::BrokerError::Unreachable(aws_sdk_sqs::error::DisplayErrorContext(e).to_string())
        })?;
    let attributes = answer.attributes.unwrap_or_default();
    let count = |a: &A| {
        attributes
            .get(a)
            .and_then(|v| v.parse::<i64>().ok())
            .unwrap_or_default()
    };
    Ok(count(&A::ApproximateNumberOfMessages) + count(&A::ApproximateNumberOfMessagesNotVisible))
}
