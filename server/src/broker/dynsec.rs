//! Sends Mosquitto dynamic-security commands over the server's own MQTT
//! connection and matches the plugin's answers to them (by
//! `correlationData`), so registering or deleting a device creates or
//! removes its broker account.
//!
//! The event loop hands every message of the response topic to
//! [`Dynsec::on_response`], which never blocks; callers await their batch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::oneshot;

use crate::broker::accounts::{command_payload, parse_responses, CommandResult};
use crate::mqtt::{ControlResponses, Publisher};
use crate::tuning::{DYNSEC_ANSWER_TIMEOUT, DYNSEC_COMMANDS_PER_BATCH};

#[derive(Debug, thiserror::Error)]
pub enum DynsecError {
    #[error("the broker's dynamic-security plugin did not answer within {0:?} (is the plugin loaded, and may the server's account publish to $CONTROL/dynamic-security/v1?)")]
    NoAnswer(Duration),
    #[error("the server's MQTT client refused the command batch: {0}")]
    Publish(String),
    #[error("{failed} of {total} dynamic-security commands failed, first: {command}: {error}")]
    Failed {
        failed: usize,
        total: usize,
        command: String,
        error: String,
    },
}

/// The waiting batches.
pub struct Dynsec {
    publisher: Publisher,
    pending: Mutex<HashMap<String, oneshot::Sender<Vec<CommandResult>>>>,
}

impl std::fmt::Debug for Dynsec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dynsec")
    }
}

impl Dynsec {
    pub fn new(publisher: Publisher) -> Arc<Self> {
        Arc::new(Self {
            publisher,
            pending: Mutex::new(HashMap::new()),
        })
    }

    /// A message on the response topic (from the event loop; never blocks).
    fn handle_response(&self, payload: &[u8]) {
        let results = match parse_responses(payload) {
            Ok(results) => results,
            Err(e) => {
                tracing::warn!(error = %e, "unreadable dynamic-security response");
                return;
            }
        };
        let Some(batch) = results.iter().find_map(|r| r.correlation.clone()) else {
            return; // another admin's commands
        };
        let waiter = self
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&batch);
        if let Some(waiter) = waiter {
            let _ = waiter.send(results);
        }
    }

    /// Sends `commands` (in batches) and returns every answer, in order.
    pub async fn execute(&self, commands: Vec<Value>) -> Result<Vec<CommandResult>, DynsecError> {
        let mut all = Vec::with_capacity(commands.len());
        for chunk in commands.chunks(DYNSEC_COMMANDS_PER_BATCH) {
            all.extend(self.execute_batch(chunk).await?);
        }
        Ok(all)
    }

    /// Like [`Dynsec::execute`], failing unless every command succeeded or
    /// found its object already as asked (`already exists`).
    pub async fn execute_all_ok(&self, commands: Vec<Value>) -> Result<(), DynsecError> {
        let total = commands.len();
        let results = self.execute(commands).await?;
        let failures: Vec<&CommandResult> = results.iter().filter(|r| !r.is_acceptable()).collect();
        match failures.first() {
            None => Ok(()),
            Some(first) => Err(DynsecError::Failed {
                failed: failures.len(),
                total,
                command: first.command.clone(),
                error: first.error.clone().unwrap_or_default(),
            }),
        }
    }

    async fn execute_batch(&self, commands: &[Value]) -> Result<Vec<CommandResult>, DynsecError> {
        let batch = uuid::Uuid::new_v4().simple().to_string();
        let payload = command_payload(commands, &batch);
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(batch.clone(), tx);
        if let Err(e) = self.publisher.publish_control(payload).await {
            self.forget(&batch);
            return Err(DynsecError::Publish(e));
        }
        match tokio::time::timeout(DYNSEC_ANSWER_TIMEOUT, rx).await {
            Ok(Ok(results)) => Ok(results),
            Ok(Err(_)) | Err(_) => {
                self.forget(&batch);
                Err(DynsecError::NoAnswer(DYNSEC_ANSWER_TIMEOUT))
            }
        }
    }

    fn forget(&self, batch: &str) {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(batch);
    }
}

impl ControlResponses for Dynsec {
    fn topic(&self) -> &str {
        crate::mqtt::RESPONSE_TOPIC
    }

    fn on_response(&self, payload: &[u8]) {
        self.handle_response(payload);
    }
}
