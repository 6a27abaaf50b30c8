//! The API's extractors — body (`ApiJson`), query (`ApiQuery`) and path
//! (`ApiPath`) — whose every rejection is the API's JSON error answer with
//! an `ErrorCode`, never axum's plain text. Bodies are decoded strictly: a
//! JSON array is never read as an object (serde would otherwise fill a
//! struct's fields from an array by position), so the server accepts
//! exactly the shapes its OpenAPI document describes.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::Json;
use idem_protocol::api::ErrorCode;
use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};
use serde::forward_to_deserialize_any;
use serde_json::{Map, Value};

use crate::http::error::ApiError;

/// A JSON body, decoded strictly; its rejections are our JSON errors.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let Json(value) = Json::<Value>::from_request(req, state)
            .await
            .map_err(json_rejection)?;
        decode_strictly(&value).map(ApiJson).map_err(invalid_body)
    }
}

/// A JSON body that may be left out: no body at all, or `null`, is
/// `T::default()`; any other is decoded as [`ApiJson`] decodes it.
pub struct ApiJsonOrEmpty<T>(pub T);

impl<S, T> FromRequest<S> for ApiJsonOrEmpty<T>
where
    T: DeserializeOwned + Default,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let (parts, body) = req.into_parts();
        let bytes = axum::body::Bytes::from_request(Request::new(body), state)
            .await
            .map_err(|e| ApiError::bad_request(ErrorCode::InvalidBody, e.body_text()))?;
        if bytes.is_empty() {
            return Ok(ApiJsonOrEmpty(T::default()));
        }
        let req = Request::from_parts(parts, axum::body::Body::from(bytes));
        let ApiJson(value) = ApiJson::<Value>::from_request(req, state).await?;
        if value.is_null() {
            return Ok(ApiJsonOrEmpty(T::default()));
        }
        decode_strictly(&value)
            .map(ApiJsonOrEmpty)
            .map_err(invalid_body)
    }
}

/// A body of the wrong shape: `422 invalid_body` with serde's words.
fn invalid_body(e: serde_json::Error) -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::InvalidBody,
        e.to_string(),
    )
}

/// `T` from `value`, refusing an array where `T` (or any part of it) is an
/// object.
pub fn decode_strictly<T: DeserializeOwned>(value: &Value) -> Result<T, serde_json::Error> {
    T::deserialize(Strict(value))
}

/// A query string; a parameter that does not fit is `400 invalid_query`.
pub struct ApiQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(value)) => Ok(ApiQuery(value)),
            Err(rejection) => Err(query_rejection(&rejection)),
        }
    }
}

/// The query rejection as the API answers it.
pub fn query_rejection(rejection: &QueryRejection) -> ApiError {
    ApiError::bad_request(ErrorCode::InvalidQuery, rejection.body_text())
}

/// Path parameters; one that does not decode is `400 invalid_path`.
pub struct ApiPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(value)) => Ok(ApiPath(value)),
            Err(rejection) => Err(path_rejection(&rejection)),
        }
    }
}

fn path_rejection(rejection: &PathRejection) -> ApiError {
    ApiError::bad_request(ErrorCode::InvalidPath, rejection.body_text())
}

// JsonRejection is #[non_exhaustive], so a catch-all arm is required here.
#[allow(clippy::wildcard_enum_match_arm)]
fn json_rejection(rejection: JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::UnsupportedMediaType,
            "send the body as JSON with `Content-Type: application/json`",
        ),
        JsonRejection::JsonSyntaxError(e) => {
            ApiError::bad_request(ErrorCode::InvalidJson, e.body_text())
        }
        JsonRejection::JsonDataError(e) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidBody,
            e.body_text(),
        ),
        other => ApiError::bad_request(ErrorCode::InvalidBody, other.body_text()),
    }
}

/// A deserializer over a decoded JSON value that, unlike
/// `serde_json::Value`'s, refuses an array for a struct.
struct Strict<'a>(&'a Value);

impl<'de> de::Deserializer<'de> for Strict<'de> {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Null => visitor.visit_unit(),
            Value::Bool(b) => visitor.visit_bool(*b),
            Value::Number(n) => {
                if let Some(u) = n.as_u64() {
                    visitor.visit_u64(u)
                } else if let Some(i) = n.as_i64() {
                    visitor.visit_i64(i)
                } else {
                    // A JSON number is a u64, an i64 or an f64.
                    visitor.visit_f64(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            Value::String(s) => visitor.visit_borrowed_str(s),
            Value::Array(items) => visitor.visit_seq(Items(items.iter())),
            Value::Object(map) => visitor.visit_map(Entries::new(map)),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            Value::Bool(_)
            | Value::Number(_)
            | Value::String(_)
            | Value::Array(_)
            | Value::Object(_) => visitor.visit_some(self),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Object(map) => visitor.visit_map(Entries::new(map)),
            Value::Null
            | Value::Bool(_)
            | Value::Number(_)
            | Value::String(_)
            | Value::Array(_) => Err(de::Error::custom(format!(
                "expected a JSON object ({name}), got {}",
                kind(self.0)
            ))),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        // The API's enums are plain words; anything else is the value
        // deserializer's business (and its error).
        match self.0 {
            Value::String(word) => visitor.visit_enum(word.as_str().into_deserializer()),
            Value::Null
            | Value::Bool(_)
            | Value::Number(_)
            | Value::Array(_)
            | Value::Object(_) => {
                de::Deserializer::deserialize_enum(self.0, name, variants, visitor)
            }
        }
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf unit unit_struct seq tuple tuple_struct map identifier ignored_any
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

struct Items<'a>(std::slice::Iter<'a, Value>);

impl<'de> de::SeqAccess<'de> for Items<'de> {
    type Error = serde_json::Error;

    fn next_element_seed<T: de::DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Self::Error> {
        self.0
            .next()
            .map(|v| seed.deserialize(Strict(v)))
            .transpose()
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

struct Entries<'a> {
    entries: serde_json::map::Iter<'a>,
    value: Option<&'a Value>,
}

impl<'a> Entries<'a> {
    fn new(map: &'a Map<String, Value>) -> Self {
        Self {
            entries: map.iter(),
            value: None,
        }
    }
}

impl<'de> de::MapAccess<'de> for Entries<'de> {
    type Error = serde_json::Error;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        match self.entries.next() {
            Some((key, value)) => {
                self.value = Some(value);
                let key: de::value::BorrowedStrDeserializer<'de, serde_json::Error> =
                    de::value::BorrowedStrDeserializer::new(key);
                seed.deserialize(key).map(Some)
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        match self.value.take() {
            Some(value) => seed.deserialize(Strict(value)),
            None => Err(de::Error::custom(
                "a map value was asked for before its key",
            )),
        }
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_protocol::api::{DeviceRegistration, DeviceUpsert, TargetedRequest, TokenRequest};
    use serde_json::json;

    #[test]
    fn an_object_body_decodes_as_serde_would_decode_it() {
        for body in [
            json!({"devices": ["a", "b"], "spec": {"v": [1, 2.5, "x", null, true]}, "force": true}),
            json!({"selector": {"labels": {"site": "north"}}}),
            json!({"all": true}),
        ] {
            let strict: TargetedRequest = decode_strictly(&body).unwrap();
            let plain: TargetedRequest = serde_json::from_value(body.clone()).unwrap();
            assert_eq!(strict, plain, "{body}");
        }
        let list = json!([{"id": "a", "labels": {"k": "v"}}, {"id": "b"}]);
        let strict: Vec<DeviceRegistration> = decode_strictly(&list).unwrap();
        assert_eq!(strict.len(), 2);
    }

    #[test]
    fn an_array_is_never_read_as_an_object_at_any_depth() {
        let top: Result<DeviceUpsert, _> = decode_strictly(&json!([{"k": "v"}]));
        assert!(top.is_err(), "serde alone reads this as labels");
        assert!(serde_json::from_value::<DeviceUpsert>(json!([{"k": "v"}])).is_ok());
        let nested: Result<TargetedRequest, _> =
            decode_strictly(&json!({"selector": [{"site": "north"}]}));
        let message = nested.unwrap_err().to_string();
        assert!(message.contains("expected a JSON object"), "{message}");
        let token: Result<TokenRequest, _> = decode_strictly(&json!(["n", "admin", null]));
        assert!(token.is_err());
    }

    #[test]
    fn unknown_fields_and_wrong_types_are_still_refused() {
        assert!(decode_strictly::<DeviceUpsert>(&json!({"labels": {}, "x": 1})).is_err());
        assert!(decode_strictly::<TargetedRequest>(&json!({"all": "yes"})).is_err());
        assert!(decode_strictly::<TargetedRequest>(&json!({"force": 1})).is_err());
    }
}
