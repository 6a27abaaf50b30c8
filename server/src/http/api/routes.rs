//! The API's one route table: every handler once, next to the access it
//! needs. A route's method and path are those of its handler's
//! `#[utoipa::path]` attribute, so the router, the role check and the
//! OpenAPI document are built from the same entry and cannot disagree.

use std::sync::Arc;

use axum::http::Method;
use axum::Router;
use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::{OpenApi, RefOr, Response, ResponseBuilder};
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouter};
use utoipa_axum::routes;

use super::{
    approvals, audit, cluster, credentials, desired, devices, exemptions, fleet, openapi, ops,
    owned, plans, rollouts, runs, tokens,
};
use crate::http::auth::{access_for, Access, AuthSettings, Role, Route};
use crate::http::sse;
use crate::http::state::AppState;

/// Every handler of the API with the access it needs.
fn table() -> Vec<(Access, UtoipaMethodRouter<Arc<AppState>>)> {
    let viewer = Access::Needs(Role::Viewer);
    let operator = Access::Needs(Role::Operator);
    let admin = Access::Needs(Role::Admin);
    vec![
        (Access::Open, routes!(ops::healthz)),
        (Access::Open, routes!(ops::readyz)),
        (viewer, routes!(ops::metrics)),
        (viewer, routes!(sse::events)),
        (viewer, routes!(fleet::fleet_summary)),
        (viewer, routes!(cluster::cluster)),
        (viewer, routes!(devices::list_devices)),
        (operator, routes!(devices::register_devices)),
        (viewer, routes!(devices::get_device)),
        (operator, routes!(devices::upsert_device)),
        (admin, routes!(devices::delete_device)),
        (operator, routes!(devices::reset_reported)),
        (operator, routes!(desired::set_device_desired)),
        (operator, routes!(runs::retry_device)),
        (admin, routes!(credentials::rotate)),
        (operator, routes!(desired::set_desired_bulk)),
        (operator, routes!(plans::create_plan)),
        (viewer, routes!(plans::get_plan)),
        (viewer, routes!(plans::plan_devices_page)),
        (operator, routes!(plans::approve_plan)),
        (operator, routes!(plans::apply_plan)),
        (admin, routes!(approvals::create_policy)),
        (viewer, routes!(approvals::list_policies)),
        (admin, routes!(approvals::delete_policy)),
        (operator, routes!(rollouts::resume_rollout)),
        (operator, routes!(rollouts::abort_rollout)),
        (operator, routes!(rollouts::approve_rollout)),
        (operator, routes!(exemptions::create_exemption)),
        (operator, routes!(exemptions::approve_exemption)),
        (viewer, routes!(exemptions::list_exemptions)),
        (operator, routes!(exemptions::delete_exemption)),
        (operator, routes!(owned::put_owned_fields)),
        (operator, routes!(owned::approve_owned_fields)),
        (viewer, routes!(owned::get_owned_fields)),
        (viewer, routes!(runs::list_runs)),
        (operator, routes!(runs::start_manual_run)),
        (viewer, routes!(runs::get_run)),
        (viewer, routes!(runs::run_outcomes)),
        (operator, routes!(runs::retry_run)),
        (admin, routes!(tokens::list_tokens)),
        (admin, routes!(tokens::create_token)),
        (admin, routes!(tokens::revoke_token)),
        (admin, routes!(audit::list_audit)),
        // The API's own description; readable by every token, like the API.
        (viewer, routes!(openapi::openapi_json)),
    ]
}

/// The router (without state and middleware), the document it is described
/// by and the access table, all from [`table`].
pub(crate) struct Api {
    pub router: Router<Arc<AppState>>,
    pub document: OpenApi,
    pub routes: Vec<Route>,
}

/// Builds the API for `settings` (which open `/metrics` and `/v1/events`
/// to callers without a token, in the document too).
pub(crate) fn build(settings: AuthSettings) -> Api {
    let mut access_table = Vec::new();
    let mut router = OpenApiRouter::with_openapi(openapi::base());
    for (access, (schemas, paths, handler)) in table() {
        for (path, item) in &paths.paths {
            for method in methods(item) {
                access_table.push(Route {
                    method,
                    path: path.clone(),
                    access,
                });
            }
        }
        router = router.routes((schemas, paths, handler));
    }
    let (router, mut document) = router.split_for_parts();
    for (path, item) in &mut document.paths.paths {
        for (method, operation) in operations(item) {
            let access = access_for(settings, &access_table, &method, path);
            describe_shared_answers(operation, access);
        }
    }
    Api {
        router,
        document,
        routes: access_table,
    }
}

impl Api {
    /// The router, carrying the document for `GET /v1/openapi.json`.
    pub fn serving_its_document(self) -> Router<Arc<AppState>> {
        let served = openapi::Served(Arc::new(self.document));
        self.router.layer(axum::Extension(served))
    }
}

/// The OpenAPI document as a server with these settings serves it.
#[cfg(test)]
pub fn document(settings: AuthSettings) -> OpenApi {
    build(settings).document
}

/// Who may call what, as the server built for `settings` decides it.
pub fn routes(settings: AuthSettings) -> Vec<Route> {
    build(settings).routes
}

/// Marks open routes as open (an empty security requirement overrides the
/// document's bearer default) and lists the answers every route can give
/// besides its own: the access refusals for routes that need a token, and
/// the server-side ones (500 on a fault, 503 while the database or the
/// connection limit refuses).
fn describe_shared_answers(operation: &mut Operation, access: Access) {
    let responses = &mut operation.responses.responses;
    let mut add = |status: &str, description: &str| {
        responses
            .entry(status.to_owned())
            .or_insert_with(|| error_response(description));
    };
    match access {
        Access::Open => operation.security = Some(Vec::new()),
        Access::Needs(_) => {
            add(
                "401",
                "no token, or one that is unknown, expired or revoked (`unauthorized`)",
            );
            add(
                "403",
                "the token's role is below the one this route needs (`forbidden`)",
            );
        }
    }
    if operation.request_body.is_some() {
        add(
            "413",
            "the body is over --http-max-body-bytes (`body_too_large`), or a list in it is over its limit (`too_many_items`)",
        );
    }
    add(
        "500",
        "a fault of the server (`internal`); details in its log",
    );
    add(
        "503",
        "the database is unavailable, the server is stopping or at its connection limit",
    );
}

fn error_response(description: &str) -> RefOr<Response> {
    RefOr::T(
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/json",
                utoipa::openapi::ContentBuilder::new()
                    .schema(Some(RefOr::Ref(utoipa::openapi::Ref::from_schema_name(
                        "ErrorBody",
                    ))))
                    .build(),
            )
            .build(),
    )
}

fn methods(item: &PathItem) -> Vec<Method> {
    operations(&mut item.clone())
        .into_iter()
        .map(|(method, _)| method)
        .collect()
}

fn operations(item: &mut PathItem) -> Vec<(Method, &mut Operation)> {
    let all = [
        (Method::GET, &mut item.get),
        (Method::PUT, &mut item.put),
        (Method::POST, &mut item.post),
        (Method::DELETE, &mut item.delete),
        (Method::OPTIONS, &mut item.options),
        (Method::HEAD, &mut item.head),
        (Method::PATCH, &mut item.patch),
        (Method::TRACE, &mut item.trace),
    ];
    all.into_iter()
        .filter_map(|(method, operation)| operation.as_mut().map(|o| (method, o)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_needs_a_token_except_health_and_readiness() {
        let routes = routes(AuthSettings::default());
        assert!(routes.len() >= 25, "{routes:?}");
        for route in &routes {
            let expected = if matches!(route.path.as_str(), "/healthz" | "/readyz") {
                Access::Open
            } else {
                route.access
            };
            assert_eq!(route.access, expected, "{} {}", route.method, route.path);
            assert_eq!(
                access_for(AuthSettings::default(), &routes, &route.method, &route.path),
                route.access
            );
        }
        assert_eq!(
            access_for(
                AuthSettings::default(),
                &routes,
                &Method::PATCH,
                "/v1/devices"
            ),
            Access::Needs(Role::Viewer)
        );
    }

    #[test]
    fn head_needs_what_get_needs() {
        let routes = routes(AuthSettings::default());
        assert_eq!(
            access_for(AuthSettings::default(), &routes, &Method::HEAD, "/healthz"),
            Access::Open
        );
        assert_eq!(
            access_for(
                AuthSettings::default(),
                &routes,
                &Method::HEAD,
                "/v1/tokens"
            ),
            Access::Needs(Role::Admin)
        );
    }

    #[test]
    fn metrics_and_events_are_opened_only_by_their_flags() {
        let routes = routes(AuthSettings::default());
        let open = AuthSettings {
            open_metrics: true,
            open_events: true,
            ..AuthSettings::default()
        };
        assert_eq!(
            access_for(open, &routes, &Method::GET, "/metrics"),
            Access::Open
        );
        assert_eq!(
            access_for(open, &routes, &Method::GET, "/v1/events"),
            Access::Open
        );
        assert_eq!(
            access_for(AuthSettings::default(), &routes, &Method::GET, "/metrics"),
            Access::Needs(Role::Viewer)
        );
    }

    #[test]
    fn only_admins_manage_tokens_and_delete_devices() {
        let routes = routes(AuthSettings::default());
        for (method, route) in [
            ("POST", "/v1/tokens"),
            ("DELETE", "/v1/tokens/{name}"),
            ("DELETE", "/v1/devices/{id}"),
            ("GET", "/v1/audit"),
        ] {
            let method = Method::from_bytes(method.as_bytes()).unwrap();
            assert_eq!(
                access_for(AuthSettings::default(), &routes, &method, route),
                Access::Needs(Role::Admin)
            );
        }
    }
}
